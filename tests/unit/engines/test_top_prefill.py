"""The lone top-priority prefill computes whole (engines/vllm/top_prefill.py), on vLLM's
own scheduler: built over the demo model's config, stepped without a model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engines.vllm.top_prefill import lone_top_prefill, uncapped

BS = 16
CAP = 64


@pytest.fixture
def scheduler(demo_model: Path) -> Any:
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    sched = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=2048, max_model_len=2048,
        long_prefill_token_threshold=CAP, enable_chunked_prefill=True, policy="priority",
        is_encoder_decoder=False,
    )  # fmt: skip
    model = ModelConfig(model=str(demo_model), dtype="float32", seed=0, max_model_len=2048)
    cache = CacheConfig(block_size=BS, enable_prefix_caching=True)
    config = VllmConfig(scheduler_config=sched, model_config=model, cache_config=cache)
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=1000, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])  # fmt: skip
    cache.num_gpu_blocks = 1000
    outputs = StructuredOutputManager(config)
    return Scheduler(vllm_config=config, kv_cache_config=kv, log_stats=True,
                     structured_output_manager=outputs, block_size=BS)  # fmt: skip


def _request(rid: str, tokens: int, priority: int) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    ids = [(ord(rid[0]) + i) % 97 for i in range(tokens)]
    return Request(request_id=rid, prompt_token_ids=ids, sampling_params=SamplingParams(
        max_tokens=8), pooling_params=None, priority=priority,
        block_hasher=get_request_block_hasher(BS, sha256))  # fmt: skip


def _step(scheduler: Any, patched: bool) -> dict[str, int]:
    from vllm.v1.core.sched.scheduler import Scheduler

    schedule = uncapped(Scheduler.schedule) if patched else Scheduler.schedule
    out = schedule(scheduler)
    assert scheduler.scheduler_config.long_prefill_token_threshold == CAP  # put back
    return dict(out.num_scheduled_tokens)


@pytest.mark.parametrize("patched", [False, True])
def test_an_interactive_prompt_beside_a_default_one(scheduler: Any, patched: bool) -> None:
    scheduler.add_request(_request("bg", 300, 0))
    scheduler.add_request(_request("agent", 500, -1))
    assert lone_top_prefill(scheduler)
    got = _step(scheduler, patched)
    # vLLM's cap cuts the interactive prompt into pieces of 64; patched, it computes whole
    # (and so may the default prompt in the same step: the gateway stops that one)
    assert got["agent"] == (500 if patched else CAP)


def test_two_interactive_prompts_share_steps_as_vllm_has_them(scheduler: Any) -> None:
    scheduler.add_request(_request("a", 500, -1))
    scheduler.add_request(_request("b", 400, -1))
    scheduler.add_request(_request("bg", 300, 0))
    assert not lone_top_prefill(scheduler)
    assert _step(scheduler, True) == {"a": CAP, "b": CAP, "bg": CAP}


def test_the_cap_is_back_once_the_top_prompt_is_computed(scheduler: Any) -> None:
    agent = _request("agent", 200, -1)
    scheduler.add_request(agent)
    scheduler.add_request(_request("bg", 300, 0))
    assert _step(scheduler, True)["agent"] == 200
    assert agent.num_computed_tokens == 200
    assert not lone_top_prefill(scheduler)  # decoding now: its prompt is computed


class _Req:
    def __init__(self, priority: int, computed: int, prompt: int = 100) -> None:
        self.priority = priority
        self.num_computed_tokens = computed
        self.num_prompt_tokens = prompt


class _Sched:
    def __init__(self, running: list[_Req], waiting: list[_Req]) -> None:
        self.running, self.waiting = running, waiting
        self.kv_holding_waiting: list[_Req] = []


def test_which_steps_are_uncapped() -> None:
    top = _Req(-1, 0)
    assert lone_top_prefill(_Sched([_Req(0, 100)], [top]))  # beside a default decode
    assert not lone_top_prefill(_Sched([], [top]))  # alone: vLLM's own rule
    assert not lone_top_prefill(_Sched([_Req(-1, 100)], [top]))  # two of the top class
    assert not lone_top_prefill(_Sched([_Req(-1, 100), _Req(0, 0)], []))  # top decodes
    assert lone_top_prefill(_Sched([_Req(1, 0)], [_Req(0, 50)]))  # default above batch
