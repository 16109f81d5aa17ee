"""The service core: the one request path that every edge (HTTP, gRPC) calls.

Edge validates into a typed request → tokenize with the model's template →
check limits → dispatch to the engine → fold usage into metrics.  Streams
start the engine before yielding anything, so errors that happen before the
first token still become a proper HTTP status.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

from engines.base import Engine, GenerateChunk, GenerateRequest, SamplingOptions
from engines.errors import EngineError
from gateway.errors import APIError, InvalidRequest, NotFound, Unavailable, from_engine_error
from gateway.metrics import Metrics
from gateway.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChunkChoice,
    ChunkDelta,
    Completion,
    CompletionChoice,
    CompletionRequest,
    ModelCard,
    ModelList,
    SamplingFields,
    Usage,
)


@dataclass(frozen=True)
class Principal:
    """Who is calling.  The tenant salts the engine's prefix cache."""

    tenant: str
    key_name: str = ""
    admin: bool = False


@dataclass
class _Totals:
    prompt: int = 0
    cached: int = 0
    completion: int = 0
    finish_reason: str = "stop"


class GatewayService:
    def __init__(
        self, engine: Engine, model_name: str, metrics: Metrics, max_inflight: int
    ) -> None:
        self._engine = engine
        self._model = model_name
        self._metrics = metrics
        self._max_inflight = max_inflight
        self._inflight = 0

    @property
    def model_name(self) -> str:
        return self._model

    @property
    def ready(self) -> bool:
        return self._engine.ready

    def models(self) -> ModelList:
        max_len = self._engine.capabilities.max_model_len if self._engine.ready else None
        return ModelList(data=[ModelCard(id=self._model, max_model_len=max_len)])

    # ------------------------------------------------------------ chat

    def _chat_request(self, req: ChatCompletionRequest, who: Principal) -> GenerateRequest:
        self._check_model(req.model)
        messages = [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in req.messages
        ]
        ids = self._engine.tokenizer.render_chat(messages)
        limit_param = "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens"
        return self._generate_request(
            "chatcmpl", ids, req, req.output_limit(), ("messages", limit_param), who
        )

    async def chat(self, req: ChatCompletionRequest, who: Principal) -> ChatCompletion:
        t0 = time.perf_counter()
        greq = self._chat_request(req, who)
        text: list[str] = []
        totals = _Totals()
        async for chunk in self._run(greq, "chat", t0, totals):
            text.append(chunk.text)
        return ChatCompletion(
            id=greq.request_id,
            model=self._model,
            choices=[
                ChatChoice(
                    message=AssistantMessage(content="".join(text)),
                    finish_reason=totals.finish_reason,
                )
            ],
            usage=Usage.of(totals.prompt, totals.completion, totals.cached),
        )

    async def chat_stream(
        self, req: ChatCompletionRequest, who: Principal
    ) -> AsyncGenerator[ChatCompletionChunk, None]:
        t0 = time.perf_counter()
        greq = self._chat_request(req, who)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        totals = _Totals()

        def chunk(delta: ChunkDelta, finish: str | None = None) -> ChatCompletionChunk:
            return ChatCompletionChunk(
                id=greq.request_id,
                model=self._model,
                choices=[ChunkChoice(delta=delta, finish_reason=finish)],
            )

        first = True
        async for out in self._run(greq, "chat", t0, totals):
            if first:  # the engine accepted the request: now the stream may begin
                yield chunk(ChunkDelta(role="assistant", content=""))
                first = False
            if out.text:
                yield chunk(ChunkDelta(content=out.text))
        yield chunk(ChunkDelta(), totals.finish_reason)
        if include_usage:
            yield ChatCompletionChunk(
                id=greq.request_id,
                model=self._model,
                choices=[],
                usage=Usage.of(totals.prompt, totals.completion, totals.cached),
            )

    # ------------------------------------------------------- completions

    def _completion_request(self, req: CompletionRequest, who: Principal) -> GenerateRequest:
        self._check_model(req.model)
        p = req.prompt
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list):
            p = p[0]
        tok = self._engine.tokenizer
        ids = tok.encode(p) if isinstance(p, str) else [int(t) for t in p]  # type: ignore[arg-type]
        if not ids:
            raise InvalidRequest("prompt must not be empty", param="prompt", code="invalid_value")
        return self._generate_request(
            "cmpl", ids, req, req.max_tokens, ("prompt", "max_tokens"), who
        )

    async def complete(self, req: CompletionRequest, who: Principal) -> Completion:
        t0 = time.perf_counter()
        greq = self._completion_request(req, who)
        text: list[str] = []
        totals = _Totals()
        async for chunk in self._run(greq, "completions", t0, totals):
            text.append(chunk.text)
        return Completion(
            id=greq.request_id,
            model=self._model,
            choices=[CompletionChoice(text="".join(text), finish_reason=totals.finish_reason)],
            usage=Usage.of(totals.prompt, totals.completion, totals.cached),
        )

    async def complete_stream(
        self, req: CompletionRequest, who: Principal
    ) -> AsyncGenerator[Completion, None]:
        t0 = time.perf_counter()
        greq = self._completion_request(req, who)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        totals = _Totals()
        async for out in self._run(greq, "completions", t0, totals):
            yield Completion(
                id=greq.request_id,
                model=self._model,
                choices=[CompletionChoice(text=out.text, finish_reason=out.finish_reason)],
            )
        if include_usage:
            yield Completion(
                id=greq.request_id,
                model=self._model,
                choices=[],
                usage=Usage.of(totals.prompt, totals.completion, totals.cached),
            )

    # ---------------------------------------------------------- shared

    def _check_model(self, model: str) -> None:
        if not self._engine.ready:
            raise Unavailable(
                "the engine is still starting", code="engine_starting", retry_after_s=5
            )
        if model != self._model:
            raise NotFound(
                f"The model '{model}' does not exist", param="model", code="model_not_found"
            )

    def _generate_request(
        self,
        prefix: str,
        ids: list[int],
        req: SamplingFields,
        limit: int | None,
        params: tuple[str, str],
        who: Principal,
    ) -> GenerateRequest:
        prompt_param, limit_param = params
        max_len = self._engine.capabilities.max_model_len
        if len(ids) >= max_len:
            raise InvalidRequest(
                f"This model's maximum context length is {max_len} tokens; "
                f"the prompt has {len(ids)} tokens",
                param=prompt_param,
                code="context_length_exceeded",
            )
        room = max_len - len(ids)
        if limit is not None and limit > room:
            raise InvalidRequest(
                f"max_tokens is {limit}, but the prompt has {len(ids)} tokens and the "
                f"model's maximum context length is {max_len}: at most {room} can be generated",
                param=limit_param,
                code="context_length_exceeded",
            )
        sampling = SamplingOptions(
            max_tokens=room if limit is None else limit,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            stop=req.stop_list(),
            seed=req.seed,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            ignore_eos=req.ignore_eos,
        )
        return GenerateRequest(
            request_id=f"{prefix}-{uuid.uuid4().hex}",
            prompt_token_ids=tuple(ids),
            sampling=sampling,
            cache_salt=f"tenant:{who.tenant}",
        )

    async def _run(
        self, greq: GenerateRequest, endpoint: str, t0: float, totals: _Totals
    ) -> AsyncIterator[GenerateChunk]:
        """Dispatch under admission control; fold usage and timing as chunks arrive."""
        if self._inflight >= self._max_inflight:
            raise Unavailable(
                "The gateway's request queue is full; retry shortly",
                code="queue_full",
                retry_after_s=1,
            )
        self._inflight += 1
        first = True
        try:
            async for chunk in self._engine.generate(greq):
                if first:
                    self._metrics.ttft.labels(endpoint).observe(time.perf_counter() - t0)
                    totals.prompt, totals.cached = chunk.num_prompt_tokens, chunk.num_cached_tokens
                    self._metrics.prompt_tokens.inc(totals.prompt)
                    self._metrics.cached_tokens.inc(totals.cached)
                    first = False
                totals.completion += len(chunk.token_ids)
                self._metrics.completion_tokens.inc(len(chunk.token_ids))
                if chunk.finish_reason is not None:
                    totals.finish_reason = chunk.finish_reason
                yield chunk
        except EngineError as exc:
            raise from_engine_error(exc) from exc
        except (GeneratorExit, asyncio.CancelledError):
            self._metrics.aborted.labels(endpoint).inc()  # the client went away
            raise
        finally:
            self._inflight -= 1


__all__ = ["APIError", "GatewayService", "Principal"]
