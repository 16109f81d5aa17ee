"""The top-priority prefill computes whole and alone (engines/vllm/top_prefill.py), on
vLLM's own scheduler under the scheduler class the gateway names (scheduler_cls,
engines/vllm/top_first_scheduler.py): built over the demo model's config, stepped
without a model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engines.vllm import top_prefill
from engines.vllm.top_prefill import STEPS, Lowered, TopFirst, lone_top_prefill, lower_prefills

BS = 16
CAP = 64


@pytest.fixture
def scheduler(demo_model: Path) -> Any:
    return _scheduler(demo_model, 1000)


def _scheduler(demo_model: Path, blocks: int, asynchronous: bool = False) -> Any:
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    sched = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=2048,
        max_model_len=2048,
        long_prefill_token_threshold=CAP,
        enable_chunked_prefill=True,
        policy="priority",
        is_encoder_decoder=False,
    )
    model = ModelConfig(model=str(demo_model), dtype="float32", seed=0, max_model_len=2048)
    cache = CacheConfig(block_size=BS, enable_prefix_caching=True)
    config = VllmConfig(scheduler_config=sched, model_config=model, cache_config=cache)
    config.scheduler_config.async_scheduling = asynchronous  # vLLM's CPU platform: off
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv = KVCacheConfig(
        num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)]
    )
    cache.num_gpu_blocks = blocks
    outputs = StructuredOutputManager(config)
    from engines.vllm.top_first_scheduler import TopFirstScheduler

    return TopFirstScheduler(
        vllm_config=config,
        kv_cache_config=kv,
        log_stats=True,
        structured_output_manager=outputs,
        block_size=BS,
    )


def _request(rid: str, tokens: int, priority: int, ids: list[int] | None = None) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    ids = ids or [(ord(rid[0]) + i) % 97 for i in range(tokens)]
    return Request(
        request_id=rid,
        prompt_token_ids=ids,
        sampling_params=SamplingParams(max_tokens=8),
        pooling_params=None,
        priority=priority,
        block_hasher=get_request_block_hasher(BS, sha256),
    )


def _step(
    scheduler: Any, patched: bool, alone: bool = False, decodes: bool = False
) -> dict[str, int]:
    scheduler.vcache_top_first = TopFirst(whole=patched, alone=alone, decodes=decodes)
    out = scheduler.schedule()
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
        self.num_tokens = prompt
        self.block_hashes: list[bytes] = []


class _Policy:
    def __init__(self, value: str) -> None:
        self.value = value


class _Pool:
    def __init__(self, free: int) -> None:
        self.free = free

    def get_num_free_blocks(self) -> int:
        return self.free

    def get_cached_block(self, h: bytes, groups: list[int]) -> None:
        return None  # nothing cached


class _Kv:
    def __init__(self, free: int) -> None:
        self.block_pool = _Pool(free)


class _Sched:
    def __init__(
        self,
        running: list[_Req],
        waiting: list[_Req],
        *,
        free: int = 100,
        seqs: int = 8,
        policy: str = "priority",
    ) -> None:
        self.running, self.waiting = running, waiting
        self.kv_holding_waiting: list[_Req] = []
        self.policy = _Policy(policy)
        self.block_size = BS
        self.kv_cache_manager = _Kv(free)
        self.max_num_running_reqs = seqs


def test_which_steps_are_uncapped() -> None:
    top = _Req(-1, 0)
    assert lone_top_prefill(_Sched([_Req(0, 100)], [top]))  # beside a default decode
    assert not lone_top_prefill(_Sched([], [top]))  # alone: vLLM's own rule
    assert not lone_top_prefill(_Sched([_Req(-1, 100)], [top]))  # two of the top class
    assert not lone_top_prefill(_Sched([_Req(-1, 100), _Req(0, 0)], []))  # top decodes
    assert lone_top_prefill(_Sched([_Req(1, 0)], [_Req(0, 50)]))  # default above batch


def test_a_batch_prompt_in_prefill_waits_for_an_interactive_one(scheduler: Any) -> None:
    scheduler.add_request(_request("b1", 600, 1))
    scheduler.add_request(_request("b2", 600, 1))
    assert _step(scheduler, True, alone=True) == {"b1": CAP, "b2": CAP}  # nothing above
    scheduler.add_request(_request("agent", 500, -1))
    # vLLM alone: the running batch prompts take their chunks of the agent's step first
    assert _step(scheduler, False) == {"b1": CAP, "b2": CAP, "agent": CAP}
    # held: the agent's step carries none of them, and its prompt computes whole
    assert _step(scheduler, True, alone=True) == {"agent": 500 - CAP}
    assert [r.request_id for r in scheduler.running] == ["b1", "b2", "agent"]
    # its prompt computed, the batch prompts go on where they were
    assert _step(scheduler, True, alone=True) == {"b1": CAP, "b2": CAP}


@pytest.mark.parametrize("alone", [False, True])
def test_a_waiting_batch_prompt_is_not_admitted_beside_it(scheduler: Any, alone: bool) -> None:
    scheduler.add_request(_request("b1", 300, 1))
    scheduler.add_request(_request("agent", 500, -1))
    got = _step(scheduler, True, alone=alone)
    # whole alone lifts the cap for the whole step: the batch prompt computes whole too
    assert got == ({"agent": 500} if alone else {"agent": 500, "b1": 300})


def test_held_waiting_prompts_keep_their_order(scheduler: Any) -> None:
    for rid, tokens in (("b1", 300), ("b2", 200)):
        scheduler.add_request(_request(rid, tokens, 1))
    scheduler.add_request(_request("d", 200, 0))
    scheduler.add_request(_request("agent", 500, -1))
    assert _step(scheduler, True, alone=True) == {"agent": 500}
    assert [r.request_id for r in scheduler.waiting] == ["d", "b1", "b2"]
    assert _step(scheduler, True, alone=True) == {"d": CAP, "b1": CAP, "b2": CAP}


def test_lower_decodes_go_on(scheduler: Any) -> None:
    bg = _request("bg", 300, 1)
    scheduler.add_request(bg)
    assert _step(scheduler, True, alone=True) == {"bg": 300}  # alone in the engine
    bg.append_output_token_ids(5)  # its first token: it decodes now
    scheduler.add_request(_request("agent", 500, -1))
    assert _step(scheduler, True, alone=True) == {"bg": 1, "agent": 500}


def test_lower_decodes_held_too(scheduler: Any) -> None:
    bg, dflt = _request("bg", 300, 1), _request("d", 200, 0)
    scheduler.add_request(bg)
    assert _step(scheduler, True, alone=True, decodes=True) == {"bg": 300}
    bg.append_output_token_ids(5)  # its first token: it decodes now
    scheduler.add_request(dflt)  # above batch: the batch answer waits for its prefill
    assert _step(scheduler, True, alone=True, decodes=True) == {"d": 200}
    dflt.append_output_token_ids(5)
    scheduler.add_request(_request("agent", 500, -1))
    free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    # the agent's prefill computes alone: both answers skip the step, their blocks kept
    assert _step(scheduler, True, alone=True, decodes=True) == {"agent": 500}
    assert [r.request_id for r in scheduler.running] == ["bg", "d", "agent"]
    assert free - scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 500 // BS + 1
    scheduler.requests["agent"].append_output_token_ids(7)  # its prompt computed
    assert _step(scheduler, True, alone=True, decodes=True) == {"bg": 1, "d": 1, "agent": 1}


def test_a_turn_whose_prefix_is_held_needs_only_its_tail(demo_model: Path) -> None:
    scheduler = _scheduler(demo_model, 64)  # 1,024 tokens of KV
    prefix = [(7 * i) % 97 for i in range(640)]  # 40 blocks
    d = _request("d", 640, 0, ids=prefix)
    scheduler.add_request(d)
    assert _step(scheduler, True, alone=True) == {"d": 640}
    d.append_output_token_ids(5)  # it decodes now and holds its 40 blocks
    scheduler.add_request(_request("b", 300, 1))
    assert _step(scheduler, True, alone=True) == {"d": 1, "b": CAP}
    d.append_output_token_ids(6)
    free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    agent = _request("agent", 740, -1, ids=[*prefix, *range(100)])  # 47 blocks in all
    scheduler.add_request(agent)
    assert 7 < free < 47  # its new tail fits; the whole prompt would not
    # held: the batch prompt takes no chunk of the agent's step (its 40 blocks are hits)
    assert _step(scheduler, True, alone=True) == {"d": 1, "agent": 100}
    # the steps the patch changed, as vcache_cache_stats reports them: the agent's only
    assert getattr(scheduler, STEPS) == {"uncapped": 1, "held": 1, "unfit": 0}


def test_a_top_prompt_that_does_not_fit_changes_nothing(demo_model: Path) -> None:
    scheduler = _scheduler(demo_model, 64)
    d = _request("d", 640, 0)
    scheduler.add_request(d)
    assert _step(scheduler, True, alone=True) == {"d": 640}
    d.append_output_token_ids(5)
    scheduler.add_request(_request("b", 300, 1))
    assert _step(scheduler, True, alone=True) == {"d": 1, "b": CAP}
    d.append_output_token_ids(6)
    scheduler.add_request(_request("agent", 740, -1))  # 47 new blocks: more than are free
    assert not lone_top_prefill(scheduler) and not lower_prefills(scheduler)
    # vLLM's step as it would be: the batch prompt keeps its chunk, capped; the agent waits
    assert _step(scheduler, True, alone=True) == {"d": 1, "b": CAP}
    assert getattr(scheduler, STEPS) == {"uncapped": 0, "held": 0, "unfit": 1}


def test_what_is_held() -> None:
    agent, bprompt, bdecode, bwait = _Req(-1, 0, 160), _Req(1, 32), _Req(1, 100), _Req(1, 0)
    got = lower_prefills(_Sched([bprompt, bdecode], [agent, bwait]))
    assert got.running == [bprompt] and got.waiting == [bwait]
    both = lower_prefills(_Sched([bprompt, bdecode], [agent, bwait]), decodes=True)
    assert both.running == [bprompt, bdecode] and both.waiting == [bwait]
    assert not lower_prefills(_Sched([bprompt], [bwait]))  # one class: vLLM's order
    assert not lower_prefills(_Sched([_Req(-1, 100), bprompt], [bwait]))  # top decodes
    # the agent's 160 tokens need 10 blocks of 16: with 9 free vLLM preempts as it would
    assert lower_prefills(_Sched([bprompt], [agent], free=10))
    assert not lower_prefills(_Sched([bprompt], [agent], free=9))
    # admitting the agent beside the held ones would pass vLLM's running limit
    assert not lower_prefills(_Sched([bprompt, bdecode], [agent], seqs=2))
    assert not lower_prefills(_Sched([bprompt], [agent], policy="fcfs"))
    assert not Lowered() and Lowered(running=[bprompt]) and Lowered(waiting=[bwait])  # any held


def test_the_scheduler_reads_what_is_on_from_the_core_environment(
    demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    for name in (top_prefill.ENV, top_prefill.ALONE_ENV, top_prefill.DECODES_ENV):
        monkeypatch.delenv(name, raising=False)
    off = _scheduler(demo_model, 100)
    assert type(off).schedule is not Scheduler.schedule  # a subclass: vLLM's own untouched
    assert off.vcache_top_first == TopFirst() and not off.vcache_top_first
    assert getattr(off, STEPS) == {"uncapped": 0, "held": 0, "unfit": 0}  # reported at once
    monkeypatch.setenv(top_prefill.ENV, "1")
    monkeypatch.setenv(top_prefill.ALONE_ENV, "1")
    assert _scheduler(demo_model, 100).vcache_top_first == TopFirst(whole=True, alone=True)
    monkeypatch.setenv(top_prefill.DECODES_ENV, "1")
    assert _scheduler(demo_model, 100).vcache_top_first == TopFirst(True, True, True)


def test_async_scheduling_keeps_vllms_async_scheduler(demo_model: Path) -> None:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from engines.vllm.top_first_scheduler import TopFirstAsyncScheduler, TopFirstScheduler

    assert not isinstance(_scheduler(demo_model, 100), AsyncScheduler)  # as vLLM picks
    scheduler = _scheduler(demo_model, 100, asynchronous=True)
    assert type(scheduler) is TopFirstAsyncScheduler
    assert isinstance(scheduler, TopFirstScheduler) and isinstance(scheduler, AsyncScheduler)
    scheduler.add_request(_request("b1", 600, 1))
    scheduler.add_request(_request("b2", 600, 1))
    assert _step(scheduler, True, alone=True) == {"b1": CAP, "b2": CAP}
    scheduler.add_request(_request("agent", 500, -1))
    assert _step(scheduler, True, alone=True) == {"agent": 500}  # whole, alone, as above
    assert getattr(scheduler, STEPS) == {"uncapped": 1, "held": 1, "unfit": 0}
