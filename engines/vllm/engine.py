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
import hashlib
import importlib
import logging
import os
from collections.abc import AsyncGenerator, Iterator
from contextlib import contextmanager
from dataclasses import replace
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
from engines.lora import LoraRef
from engines.tokenizer import ChatTokenizer
from engines.vllm.core_holds import HOLD_ARG
from engines.vllm.detokenize import AnswerText, byte_level, detokenized_here
from engines.vllm.engine_config import (
    VllmEngineConfig,
    core_environment,
    engine_args,
    vcache_scheduler,
)
from engines.vllm.lifeline import GATEWAY_PID_ENV
from engines.vllm.placement import core_env
from engines.vllm.sampling import sampling_fields, stop_string
from engines.vllm.shared_core import CoreSlot
from engines.vllm.stats import CoreStats

if TYPE_CHECKING:
    from vllm.inputs import TokensPrompt
    from vllm.inputs.engine import TokensInput
    from vllm.v1.engine.async_llm import AsyncLLM

log = logging.getLogger(__name__)


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
        self._detokenizes = False  # answers detokenized an output at a time (detokenize.py)
        self._core_stats = CoreStats()
        # vLLM names an adapter by an int id too: by name, the id and path given it last
        self._lora_ids: dict[str, tuple[int, str]] = {}

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
        with environment_read_afresh():
            if self._slot is None:
                with core_env(core_environment(self._config)):  # replicas start one at a time
                    llm = await asyncio.to_thread(
                        AsyncLLM.from_engine_args, args, stat_loggers=loggers
                    )
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
        self._detokenizes = byte_level(llm.tokenizer)
        self._llm = llm
        for adapter in self._config.adapters:  # vLLM's --lora-modules
            await self.load_adapter(adapter)
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
        prompt = _tokens_prompt(request)
        if request.cache_salt is not None:
            prompt["cache_salt"] = request.cache_salt
        params = _sampling_params(request)
        if request.hold is not None:  # taken by the core as it queues the request
            h = request.hold
            params.extra_args = {HOLD_ARG: [list(h.hashes), h.max_share, h.reserve, h.ttl_s]}
        here: AnswerText | None = None
        if self._detokenizes and detokenized_here(request):  # an output at a time, not a token
            params.detokenize = False
            here = AnswerText(llm.tokenizer, request, params)
        lora = self._lora_request(request.lora) if request.lora is not None else None
        stream = llm.generate(
            prompt,
            params,
            request_id=request.request_id,
            priority=request.priority,
            lora_request=lora,
        )
        finished = False
        first = True
        # a streamed answer's outputs read at most once per interval: what the engine
        # made meanwhile, vLLM's output collector has merged into one (several tokens,
        # one piece, one SSE event); an answer sent whole is coalesced by vLLM already
        interval = self._config.output_interval_s if request.sampling.stream_interval is None else 0
        loop = asyncio.get_running_loop()
        due = 0.0
        try:
            while True:
                if not finished and interval and (wait := due - loop.time()) > 0:
                    await asyncio.sleep(wait)
                out = await anext(stream, None)
                if out is None:
                    break
                due = loop.time() + interval
                finished = out.finished
                times = _core_times(out) if first else None  # on the first chunk only
                prompt_lps = _prompt_logprobs(out, request) if first else None
                held = _held(out) if first and request.hold is not None else None
                first = False
                for completion in out.outputs:
                    done = completion.finish_reason is not None or (
                        out.finished and request.sampling.n == 1
                    )
                    ids = tuple(completion.token_ids)
                    text = completion.text
                    if here is not None:
                        ended = completion.finish_reason == "stop"  # by EOS or a stop token
                        text = here.add(completion.index, ids, done, ended)
                    yield GenerateChunk(
                        text=text,
                        token_ids=ids,
                        num_prompt_tokens=len(out.prompt_token_ids or ()),
                        num_cached_tokens=out.num_cached_tokens or 0,
                        finish_reason=_finish_reason(completion.finish_reason) if done else None,
                        stop_sequence=stop_string(completion.stop_reason) if done else None,
                        index=completion.index,
                        logprobs=_logprobs(completion, request.sampling.logprobs),
                        core_times=times,
                        prompt_logprobs=prompt_lps,
                        hold=held,
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

    # ------------------------------------------------------------ LoRA

    @property
    def lora_enabled(self) -> bool:
        return self._config.enable_lora

    def _lora_request(self, adapter: LoraRef) -> Any:
        """vLLM's ``LoRARequest`` for ``adapter``, its int id :func:`lora_id` (another
        when the name is given another path: vLLM must not take the new weights for the
        old; the same in every gateway worker attached to one core)."""
        from vllm.lora.request import LoRARequest

        known = (lora_id(adapter), adapter.path)
        self._lora_ids[adapter.name] = known
        return LoRARequest(adapter.name, known[0], adapter.path)

    async def load_adapter(self, adapter: LoraRef) -> None:
        llm = self._llm
        if llm is None or self._closed:
            raise EngineUnavailable("engine is not ready")
        if not self._config.enable_lora:
            raise EngineInputError(
                f"adapter '{adapter.name}': this engine runs without LoRA (engine.lora.enabled)"
            )
        before = self._lora_ids.get(adapter.name)
        if before is not None and before[1] != adapter.path:
            await self.unload_adapter(adapter.name)  # the name is re-pointed
        req = self._lora_request(adapter)
        try:
            await llm.add_lora(req)
        except Exception as exc:
            if llm.errored:
                raise EngineUnavailable(f"the engine died loading '{adapter.name}'") from exc
            self._lora_ids.pop(adapter.name, None)
            raise EngineInputError(
                f"adapter '{adapter.name}' could not be loaded from {adapter.path}: {_cause(exc)}",
                param="lora_path",
            ) from exc

    async def unload_adapter(self, name: str) -> bool:
        llm = self._llm
        if llm is None or self._closed:
            raise EngineUnavailable("engine is not ready")
        known = self._lora_ids.pop(name, None)
        if known is None:
            return False
        try:
            return bool(await llm.remove_lora(known[0]))
        except Exception as exc:
            raise EngineUnavailable(f"unloading '{name}' failed: {exc}") from exc

    async def adapters(self) -> list[LoraRef]:
        llm = self._llm
        if llm is None or self._closed or not self._config.enable_lora:
            return []
        try:
            held = await llm.list_loras()
        except Exception as exc:
            raise EngineUnavailable(f"listing adapters failed: {exc}") from exc
        return [LoraRef(n, path) for n, (i, path) in self._lora_ids.items() if i in held]

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

    @property
    def holds_in_request(self) -> bool:
        """Whether a request's :attr:`~engines.base.GenerateRequest.hold` is taken: its
        engine core runs vcache's scheduler class (engines/vllm/core_holds.py); under
        vLLM's own, holds are core calls."""
        return vcache_scheduler(self._config) and self._llm is not None and not self._closed

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._llm is not None:
            llm, self._llm = self._llm, None
            await asyncio.to_thread(llm.shutdown)
            close_client_context(llm)


def close_client_context(engine: object) -> None:
    """Terminate the ZMQ context of the engine-core client of ``engine`` (vLLM's
    ``AsyncLLM``, or the ``LLMEngine`` of its offline ``LLM``), and with it its I/O and
    reaper threads.  vLLM's shutdown closes the client's sockets (on this loop, queued
    before the shutdown's thread returned: closed by now) but leaves the context to
    whoever drops the client last: pyzmq destroys it then, with a ResourceWarning, at
    once when nothing else holds the client, when the garbage collector gets to it
    otherwise; until then a replica closed or restarted in this process keeps three
    native threads and their file descriptors."""
    resources = getattr(getattr(engine, "engine_core", None), "resources", None)
    ctx = getattr(resources, "ctx", None)
    if ctx is not None and not ctx.closed:
        ctx.destroy(linger=0)  # sockets still open (a client that died early): closed too


@contextmanager
def environment_read_afresh() -> Iterator[None]:
    """vLLM's environment variables read afresh while the block runs (an engine starting:
    ``core_env`` sets its core's variables meanwhile), then cached, as vLLM's engine core
    caches its own once started (``vllm.envs.enable_envs_cache``): vLLM's output handler
    in this process reads one on every engine output of every request
    (``IterationStats.update_from_output``: ``VLLM_COMPUTE_NANS_IN_LOGITS``), an
    ``os.environ`` lookup and a parse each.  The environment is not changed under a
    running engine (vLLM's rule for the cache)."""
    from vllm import envs

    envs.disable_envs_cache()
    try:
        yield
    finally:
        envs.enable_envs_cache()


def _held(out: Any) -> tuple[int, str] | None:
    """The answer to the hold a request carried, from its first output (None: none came:
    the output was merged with later ones past the outputs that carry it)."""
    answer = (out.kv_transfer_params or {}).get(HOLD_ARG)
    if not isinstance(answer, list | tuple) or len(answer) != 2:
        return None
    return int(answer[0]), str(answer[1])


def _sampling_params(request: GenerateRequest) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    fields = sampling_fields(request.sampling)
    if "structured_outputs" in fields:
        fields["structured_outputs"] = StructuredOutputsParams(**fields["structured_outputs"])
    # made afresh for each request and read by nothing else: vLLM's input processor then
    # copies it shallowly, not deeply (the deep copy was 1.7% of the loop's busy time on
    # whole answers), as vLLM's own server asks (ChatCompletionRequest.to_sampling_params)
    return SamplingParams(**fields, output_kind=RequestOutputKind.DELTA, skip_clone=True)


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


def lora_id(adapter: LoraRef) -> int:
    """vLLM's int id of ``adapter``: from its name and path (positive, 31 bits), so the
    gateway workers that share an engine core, and a restarted gateway, agree on it."""
    digest = hashlib.sha256(f"{adapter.name}\0{adapter.path}".encode()).digest()
    return int.from_bytes(digest[:4], "big") % (2**31 - 1) + 1


def _cause(exc: BaseException) -> str:
    """The innermost message of a failure raised through the engine core."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return str(exc) or type(exc).__name__


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


def _tokens_prompt(request: GenerateRequest) -> TokensInput | TokensPrompt:
    """The prompt as vLLM takes it: the token ids as vLLM's renderer hands them to its
    engine (``TokensInput``: ``AsyncLLM.add_request`` takes a rendered input as it is, on
    the loop, where a raw prompt goes through its renderer on a thread pool, a hop and a
    thread's CPU a request for ids that need no tokenizing), or, with images, the
    template's ids (one image token per image) and the images loaded as vLLM's server
    loads a data URL's bytes (``ImageMediaIO.load_bytes``: turned upright by EXIF,
    converted to RGB, kept with the original bytes as ``MediaWithBytes``; vLLM's
    identifier is blake3 over those bytes and the conversion, or the client's uuid where
    it gave one), a raw prompt whose images vLLM's renderer processes off the loop."""
    from vllm.inputs import TokensPrompt
    from vllm.inputs.engine import tokens_input

    if not request.images:
        return tokens_input(list(request.prompt_token_ids))
    from vllm.multimodal.media.image import ImageMediaIO

    assert request.template_token_ids is not None  # GenerateRequest checks it
    loader = ImageMediaIO()
    media = [loader.load_bytes(i.data) for i in request.images]
    prompt = TokensPrompt(
        prompt_token_ids=list(request.template_token_ids),
        multi_modal_data={"image": media},
    )
    if any(i.uuid is not None for i in request.images):
        prompt["multi_modal_uuids"] = {"image": [i.uuid for i in request.images]}
    return prompt
