"""What an embedded vLLM engine core is started with: its configuration
(:class:`VllmEngineConfig`), vLLM's engine arguments for it (prefix caching hashed as the
manifest hashes; the scheduler class that serves the top-priority prefill first, when it
is on) and what the core's environment adds (placement, which of the scheduler's changes
are on, niceness).

Both ways of running a core read it: its own child process (``engine.py``) and one core
shared by ``--workers`` (``shared_core.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from engines.lora import LoraRef
from engines.vllm import niceness, top_prefill
from engines.vllm.placement import Env

HASH_ALGO = "sha256_cbor"
CPU_DEFAULT_KV_CACHE_BYTES = 1 << 30


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


@dataclass(frozen=True)
class VllmEngineConfig:
    model: str
    served_name: str
    max_model_len: int = 2048
    block_size: int | None = None  # None: the platform's default (128 on CPU)
    kv_cache_bytes: int | None = None  # None: vLLM sizes it from gpu_memory_utilization
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    hash_seed: str = "0"
    max_queued_requests: int | None = None
    tensor_parallel_size: int = 1
    dtype: str = "auto"
    # KV events (ZMQ PUB) and their replay endpoint; None disables events.
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    scheduling_policy: str = "fcfs"  # "priority": requests ordered by their priority first
    max_num_seqs: int | None = None  # None: vLLM's default
    long_prefill_token_threshold: int | None = None  # None: vLLM's default
    # the engine core's own devices or CPU cores (engines/vllm/placement.py)
    placement: Env = ()
    # the lone top-priority prefill runs uncapped; lower classes' prefills wait for the
    # top class's: vLLM's scheduler_cls engines/vllm/top_first_scheduler.py, the logic in
    # engines/vllm/top_prefill.py
    top_prefill_whole: bool = False
    top_prefill_alone: bool = False
    top_prefill_decodes: bool = False  # with alone: the lower classes' decodes wait too
    # the engine processes' niceness above the gateway's; None: by platform
    # (engines/vllm/niceness.py)
    nice: int | None = None
    # LoRA (vLLM's --enable-lora, --max-loras, --max-lora-rank, --max-cpu-loras); the
    # adapters to load at start are loaded by the engine (engine.py), not its arguments
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    adapters: tuple[LoraRef, ...] = ()  # loaded at every start (a restart loads them again)
    # a vision model's images per prompt (vLLM's limit_mm_per_prompt); None: text only or
    # vLLM's default
    max_images_per_prompt: int | None = None
    # a streamed answer's outputs are read at most once per this many seconds, what came
    # meanwhile merged into one (engine.output_interval_ms); 0: each as it comes
    output_interval_s: float = 0.0


def core_environment(c: VllmEngineConfig) -> Env:
    """What the engine core's environment adds: its placement, which of the scheduler's
    changes are on (read by the scheduler class, :func:`engine_args`), its niceness."""
    own = os.getpriority(os.PRIO_PROCESS, 0)  # the gateway's
    n = niceness.engine_nice(c.nice, _on_cpu(), own)
    nice = ((niceness.NICE_ENV, str(n)),) if n != own else ()
    return (*c.placement, *_top_first(c).environment(), *nice)


def _top_first(c: VllmEngineConfig) -> top_prefill.TopFirst:
    return top_prefill.TopFirst(c.top_prefill_whole, c.top_prefill_alone, c.top_prefill_decodes)


def vcache_scheduler(c: VllmEngineConfig) -> bool:
    """Whether the engine core runs vcache's scheduler class (``scheduler_cls``,
    engines/vllm/top_first_scheduler.py), which also takes holds carried in requests
    (engines/vllm/core_holds.py); else vLLM's own."""
    return bool(_top_first(c))


def engine_args(c: VllmEngineConfig) -> Any:
    """vLLM's engine arguments for ``c``: prefix caching hashed as the manifest hashes
    (an adapter's blocks keyed by its name and path); LoRA when enabled;
    vLLM's scheduler with the top-priority prefill first (``scheduler_cls``) when
    ``top_prefill_whole`` or ``top_prefill_alone`` is on (``top_prefill_decodes`` goes
    with the latter), vLLM's own otherwise."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    kwargs: dict[str, Any] = dict(
        model=c.model,
        served_model_name=c.served_name,
        enable_prefix_caching=True,
        prefix_caching_hash_algo=HASH_ALGO,
        max_model_len=c.max_model_len,
        enforce_eager=c.enforce_eager,
        gpu_memory_utilization=c.gpu_memory_utilization,
        tensor_parallel_size=c.tensor_parallel_size,
        dtype=c.dtype,
        disable_log_stats=False,  # stats feed CoreStats (engine-core truth)
        structured_outputs_config=_compact_json(),
        scheduling_policy=c.scheduling_policy,
    )
    if vcache_scheduler(c):
        kwargs["scheduler_cls"] = top_prefill.SCHEDULER_CLS
    if c.enable_lora:
        kwargs.update(enable_lora=True, max_loras=c.max_loras, max_lora_rank=c.max_lora_rank)
        if c.max_cpu_loras is not None:
            kwargs["max_cpu_loras"] = c.max_cpu_loras
    if c.max_images_per_prompt is not None:
        kwargs["limit_mm_per_prompt"] = {"image": c.max_images_per_prompt}
    if c.block_size is not None:
        kwargs["block_size"] = c.block_size
    if c.max_num_seqs is not None:
        kwargs["max_num_seqs"] = c.max_num_seqs
    if c.long_prefill_token_threshold is not None:
        kwargs["long_prefill_token_threshold"] = c.long_prefill_token_threshold
    kv_bytes = c.kv_cache_bytes
    if kv_bytes is None and _on_cpu():
        # On CPU, gpu_memory_utilization reserves that share of a NUMA node's
        # memory and fails when other processes use some: size the cache instead.
        kv_bytes = CPU_DEFAULT_KV_CACHE_BYTES
    if kv_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = kv_bytes
    if c.max_queued_requests is not None:
        kwargs["max_num_queued_reqs"] = c.max_queued_requests
    if c.kv_events_endpoint is not None:
        from vllm.config.kv_events import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=c.kv_events_endpoint,
            replay_endpoint=c.kv_events_replay_endpoint,
        )
    return AsyncEngineArgs(**kwargs)


def _compact_json() -> Any:
    """Structured outputs allow no free whitespace between JSON tokens, so a weak model
    cannot spend its whole budget on blank lines (the JSON is as valid).  vLLM reads this
    from the engine's config, not from each request."""
    from vllm.config import StructuredOutputsConfig

    return StructuredOutputsConfig(backend="xgrammar", disable_any_whitespace=True)
