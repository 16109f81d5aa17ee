"""vLLM embedded in-process through ``AsyncLLM``.

Prefix caching is always on, hashed with ``sha256_cbor`` and a fixed
``PYTHONHASHSEED`` in the engine process, so the manifest can compute the
same block hashes vLLM does.  The engine core runs in a child process that
inherits this process's environment; the seed is therefore set before the
engine is created.

Code that starts this engine needs an ``if __name__ == "__main__"`` guard
(the engine core is spawned as a child process).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
from collections.abc import AsyncGenerator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import anyio

from engines.base import (
    LOGPROB_FLOOR,
    CoreTimes,
    EngineCapabilities,
    EngineStats,
    GenerateChunk,
    GenerateRequest,
    TokenLogprob,
)
from engines.errors import (
    EngineError,
    EngineGenerationFailed,
    EngineInputError,
    EngineOverloaded,
    EngineUnavailable,
)
from engines.tokenizer import ChatTokenizer
from engines.vllm import niceness, top_prefill
from engines.vllm.lifeline import GATEWAY_PID_ENV
from engines.vllm.placement import Env, core_env
from engines.vllm.sampling import sampling_fields, stop_string
from engines.vllm.shared_core import CoreSlot
from engines.vllm.stats import CoreStats

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

log = logging.getLogger(__name__)

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
    # top class's (engines/vllm/top_prefill.py)
    top_prefill_whole: bool = False
    top_prefill_alone: bool = False
    top_prefill_decodes: bool = False  # with alone: the lower classes' decodes wait too
    # the engine processes' niceness above the gateway's; None: by platform
    # (engines/vllm/niceness.py)
    nice: int | None = None


def core_environment(c: VllmEngineConfig) -> Env:
    """What the engine core's environment adds: its placement, the scheduler's patches,
    its niceness."""
    patches = (
        (top_prefill.ENV, c.top_prefill_whole),
        (top_prefill.ALONE_ENV, c.top_prefill_alone),
        (top_prefill.DECODES_ENV, c.top_prefill_decodes),
    )
    own = os.getpriority(os.PRIO_PROCESS, 0)  # the gateway's
    n = niceness.engine_nice(c.nice, _on_cpu(), own)
    nice = ((niceness.NICE_ENV, str(n)),) if n != own else ()
    return (*c.placement, *((env, "1") for env, on in patches if on), *nice)


def engine_args(c: VllmEngineConfig) -> Any:
    """vLLM's engine arguments for ``c``: prefix caching hashed as the manifest hashes."""
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


class VllmEngine:
    """One replica's engine: its own engine core (a child process), or, under
    ``--workers``, a slot of an engine core the workers' parent runs
    (``engines/vllm/shared_core.py``)."""

    def __init__(self, config: VllmEngineConfig, slot: CoreSlot | None = None) -> None:
        self._config = config
        self._slot = slot
        self._llm: AsyncLLM | None = None
        self._tokenizer: ChatTokenizer | None = None
        self._capabilities: EngineCapabilities | None = None
        self._closed = False
        self._core_stats = CoreStats()

    @property
    def capabilities(self) -> EngineCapabilities:
        if self._capabilities is None:
            raise EngineUnavailable("engine not started")
        return self._capabilities

    @property
    def tokenizer(self) -> ChatTokenizer:
        if self._tokenizer is None:
            raise EngineUnavailable("engine not started")
        return self._tokenizer

    @property
    def ready(self) -> bool:
        if self._llm is None or self._closed or self._llm.errored:
            return False
        return self._slot is None or self._slot.alive()

    async def start(self) -> None:
        if self._llm is not None or self._closed:
            raise EngineUnavailable("engine already started or closed")
        if self._slot is None:
            # The engine core process inherits the environment: block hashes are
            # seeded by PYTHONHASHSEED there (vllm.v1.core.kv_cache_utils).
            os.environ["PYTHONHASHSEED"] = self._config.hash_seed
            # ...and dies with this process (engines/vllm/lifeline.py).
            os.environ[GATEWAY_PID_ENV] = str(os.getpid())
        # vLLM's first import takes seconds: off the loop, which serves /healthz meanwhile
        await asyncio.to_thread(importlib.import_module, "vllm.v1.engine.async_llm")
        from vllm.v1.engine.async_llm import AsyncLLM

        args = engine_args(self._config)
        tokenizer = await asyncio.to_thread(ChatTokenizer.from_pretrained, self._config.model)
        loggers = [self._core_stats.factory()]
        # Building the engine blocks for tens of seconds: keep the loop free
        # so /healthz answers while the model loads.
        if self._slot is None:
            with core_env(core_environment(self._config)):  # replicas start one at a time
                llm = await asyncio.to_thread(AsyncLLM.from_engine_args, args, stat_loggers=loggers)
        else:  # the engine core runs already: attach to it
            llm = await asyncio.to_thread(self._slot.attach, args, loggers)
        cache = llm.vllm_config.cache_config
        self._capabilities = EngineCapabilities(
            name="vllm",
            max_model_len=llm.model_config.max_model_len,
            block_size=cache.block_size,
            exact_prefix_cache=True,
            hash_algo=str(cache.prefix_caching_hash_algo),
            hash_seed=self._config.hash_seed,
            span_control=True,
            vocab_size=llm.model_config.get_vocab_size(),
            model=str(llm.model_config.model),
        )
        self._tokenizer = tokenizer
        self._llm = llm
        log.info(
            "vLLM engine ready: model=%s block_size=%d max_model_len=%d",
            self._config.served_name,
            cache.block_size,
            self._capabilities.max_model_len,
        )

    def stats(self) -> EngineStats:
        unfinished = 0 if self._llm is None else self._llm.get_num_unfinished_requests()
        return replace(self._core_stats.snapshot, unfinished_requests=unfinished)

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[GenerateChunk, None]:
        llm = self._llm
        if llm is None or self._closed:
            raise EngineUnavailable("engine is not ready")
        from vllm.inputs import TokensPrompt

        prompt: TokensPrompt = {"prompt_token_ids": list(request.prompt_token_ids)}
        if request.cache_salt is not None:
            prompt["cache_salt"] = request.cache_salt
        params = _sampling_params(request)
        stream = llm.generate(
            prompt, params, request_id=request.request_id, priority=request.priority
        )
        finished = False
        first = True
        try:
            async for out in stream:
                finished = out.finished
                times = _core_times(out) if first else None  # on the first chunk only
                prompt_lps = _prompt_logprobs(out, request) if first else None
                first = False
                for completion in out.outputs:
                    done = completion.finish_reason is not None or (
                        out.finished and request.sampling.n == 1
                    )
                    yield GenerateChunk(
                        text=completion.text,
                        token_ids=tuple(completion.token_ids),
                        num_prompt_tokens=len(out.prompt_token_ids or ()),
                        num_cached_tokens=out.num_cached_tokens or 0,
                        finish_reason=_finish_reason(completion.finish_reason) if done else None,
                        stop_sequence=stop_string(completion.stop_reason) if done else None,
                        index=completion.index,
                        logprobs=_logprobs(completion, request.sampling.logprobs),
                        core_times=times,
                        prompt_logprobs=prompt_lps,
                    )
                    times = None
        except EngineError:
            raise
        except Exception as exc:  # translated at the edge, most specific first
            raise _translate(exc) from exc
        finally:
            if not finished:
                # The client went away (or the request failed).  vLLM's generate
                # aborts on cancellation too, but its await can be cut short by a
                # cancel scope; the shielded abort makes sure the engine core hears it.
                with anyio.CancelScope(shield=True):
                    await stream.aclose()
                    await llm.abort(request.request_id)

    async def call_core(self, method: str, *args: Any) -> Any:
        """Run a utility method in the engine core (the vcache plugin's pin/evict/...)."""
        if self._llm is None or self._closed:
            raise EngineUnavailable("engine is not ready")
        try:
            return await self._llm.engine_core.call_utility_async(method, *args)
        except EngineError:
            raise
        except Exception as exc:  # a dead core (EngineDeadError), a plugin's own failure
            raise EngineUnavailable(f"engine core call {method} failed: {exc}") from exc

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._llm is not None:
            llm, self._llm = self._llm, None
            await asyncio.to_thread(llm.shutdown)


def _sampling_params(request: GenerateRequest) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    fields = sampling_fields(request.sampling)
    if "structured_outputs" in fields:
        fields["structured_outputs"] = StructuredOutputsParams(**fields["structured_outputs"])
    return SamplingParams(**fields, output_kind=RequestOutputKind.DELTA)


def _compact_json() -> Any:
    """Structured outputs allow no free whitespace between JSON tokens, so a weak model
    cannot spend its whole budget on blank lines (the JSON is as valid).  vLLM reads this
    from the engine's config, not from each request."""
    from vllm.config import StructuredOutputsConfig

    return StructuredOutputsConfig(backend="xgrammar", disable_any_whitespace=True)


def _step(token_id: int, step: dict[int, Any], top: int) -> TokenLogprob:
    """One step's vLLM {id: Logprob} map: the token's logprob and rank, the top ones."""
    chosen = step.get(token_id)
    ranked = sorted(step.items(), key=lambda kv: kv[1].rank or 0)[:top]
    return TokenLogprob(
        token=(chosen.decoded_token or "") if chosen else "",
        logprob=max(chosen.logprob, LOGPROB_FLOOR) if chosen else LOGPROB_FLOOR,
        top=tuple((lp.decoded_token or "", max(lp.logprob, LOGPROB_FLOOR)) for _, lp in ranked),
        token_id=token_id,
        top_ids=tuple(i for i, _ in ranked),
        rank=chosen.rank if chosen else None,
    )


def _logprobs(completion: Any, top: int | None) -> tuple[TokenLogprob, ...]:
    """vLLM's per-token {id: Logprob} maps as (token, logprob, top alternatives)."""
    if top is None or not completion.logprobs:
        return ()
    steps = zip(completion.token_ids, completion.logprobs, strict=False)
    return tuple(_step(t, step, top) for t, step in steps)


def _prompt_logprobs(out: Any, request: GenerateRequest) -> tuple[TokenLogprob | None, ...] | None:
    """The prompt's logprobs vLLM computed (its first token has none), where asked."""
    top = request.sampling.prompt_logprobs
    if top is None or not out.prompt_logprobs:
        return None
    ids = out.prompt_token_ids or request.prompt_token_ids
    return tuple(
        None if step is None else _step(t, step, top)
        for t, step in zip(ids, out.prompt_logprobs, strict=False)
    )


def _core_times(out: Any) -> CoreTimes | None:
    """The core's queued, scheduled and first-token stamps (None: not all reported)."""
    stats = getattr(out, "metrics", None)
    stamps = [getattr(stats, f, 0.0) for f in ("queued_ts", "scheduled_ts", "first_token_ts")]
    return CoreTimes(*stamps) if all(stamps) else None


def _finish_reason(reason: str | None) -> str:
    return reason if reason in ("stop", "length", "abort") else "stop"


def _translate(exc: Exception) -> EngineError:
    from vllm.exceptions import GracefulHTTPError, VLLMClientError, VLLMValidationError
    from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

    if isinstance(exc, VLLMValidationError):
        return EngineInputError(str(exc), param=exc.parameter)
    if isinstance(exc, VLLMClientError):
        return EngineInputError(str(exc))
    if isinstance(exc, GracefulHTTPError):
        if int(exc.http_status) == 503:
            return EngineOverloaded(exc.message)
        return EngineInputError(exc.message)
    if isinstance(exc, ValueError):  # vLLM's input processor rejects prompts with ValueError
        return EngineInputError(str(exc))
    if isinstance(exc, EngineDeadError):
        return EngineUnavailable("the engine process died")
    if isinstance(exc, EngineGenerateError):
        return EngineGenerationFailed("generation failed inside the engine")
    return EngineGenerationFailed(f"{type(exc).__name__}: {exc}")
