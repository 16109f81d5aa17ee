"""The service core: the one request path that every edge (HTTP, gRPC) calls.

Edge validates into a typed request → tokenize with the model's template →
check limits → route to a replica (gateway/dispatch.py) → stream → fold usage.
Streams start the engine before yielding anything, so errors that happen
before the first token still become a proper HTTP status.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Generic, TypeVar

from engines.base import Engine, GenerateRequest, SamplingOptions
from gateway.dispatch import Dispatch, Dispatcher, Totals
from gateway.errors import InvalidRequest, NotFound, Unavailable
from gateway.replicas import RouteOverride
from gateway.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessage,
    ChunkChoice,
    ChunkDelta,
    Completion,
    CompletionChoice,
    CompletionRequest,
    ModelCard,
    ModelList,
    SamplingFields,
)


def tenant_salt(tenant: str) -> str:
    """vLLM's cache_salt for a tenant: tenants never share a prefix-cache span."""
    return f"tenant:{tenant}"


@dataclass(frozen=True)
class Principal:
    """Who is calling.  The tenant salts the engine's prefix cache."""

    tenant: str
    key_name: str = ""
    admin: bool = False


T = TypeVar("T")


@dataclass(frozen=True)
class Routed(Generic[T]):
    """A result and where it was served (for the x-vcache-* response headers)."""

    body: T
    dispatch: Dispatch

    def headers(self) -> dict[str, str]:
        return self.dispatch.headers()


class GatewayService:
    def __init__(self, dispatcher: Dispatcher, model_name: str) -> None:
        self._dispatcher = dispatcher
        self._model = model_name

    @property
    def model_name(self) -> str:
        return self._model

    @property
    def dispatcher(self) -> Dispatcher:
        return self._dispatcher

    @property
    def _engine(self) -> Engine:
        """The first replica: all replicas serve the same model and tokenizer."""
        return self._dispatcher.replicas[0].engine

    @property
    def ready(self) -> bool:
        d = self._dispatcher
        return d.started and all(r.engine.ready for r in d.replicas)

    def models(self) -> ModelList:
        max_len = self._engine.capabilities.max_model_len if self.ready else None
        return ModelList(data=[ModelCard(id=self._model, max_model_len=max_len)])

    def chat_tokens(self, messages: list[ChatMessage]) -> list[int]:
        """Token ids of ``messages`` through the model's chat template."""
        rendered = [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in messages
        ]
        return self._engine.tokenizer.render_chat(rendered)

    def text_tokens(self, text: str) -> list[int]:
        return self._engine.tokenizer.encode(text)

    # ------------------------------------------------------------ chat

    def _chat_request(self, req: ChatCompletionRequest, who: Principal) -> GenerateRequest:
        self.check_model(req.model)
        ids = self.chat_tokens(req.messages)
        limit_param = "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens"
        return self._generate_request(
            "chatcmpl", ids, req, req.output_limit(), ("messages", limit_param), who
        )

    async def chat(
        self, req: ChatCompletionRequest, who: Principal, route: RouteOverride | None = None
    ) -> Routed[ChatCompletion]:
        t0 = time.perf_counter()
        greq = self._chat_request(req, who)
        d = await self._dispatcher.route(greq, route)
        text: list[str] = []
        totals = Totals()
        async with aclosing(self._dispatcher.run(greq, d, "chat", t0, totals)) as chunks:
            async for chunk in chunks:
                text.append(chunk.text)
        body = ChatCompletion(
            id=greq.request_id,
            model=self._model,
            choices=[
                ChatChoice(
                    message=AssistantMessage(content="".join(text)),
                    finish_reason=totals.finish_reason,
                )
            ],
            usage=totals.usage(),
        )
        return Routed(body, d)

    async def chat_stream(
        self, req: ChatCompletionRequest, who: Principal, route: RouteOverride | None = None
    ) -> Routed[AsyncGenerator[ChatCompletionChunk, None]]:
        t0 = time.perf_counter()
        greq = self._chat_request(req, who)
        d = await self._dispatcher.route(greq, route)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(delta: ChunkDelta, finish: str | None = None) -> ChatCompletionChunk:
            return ChatCompletionChunk(
                id=greq.request_id,
                model=self._model,
                choices=[ChunkChoice(delta=delta, finish_reason=finish)],
            )

        async def stream() -> AsyncGenerator[ChatCompletionChunk, None]:
            totals = Totals()
            first = True
            async with aclosing(self._dispatcher.run(greq, d, "chat", t0, totals)) as chunks:
                async for out in chunks:
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
                    usage=totals.usage(),
                )

        return Routed(stream(), d)

    # ------------------------------------------------------- completions

    def _completion_request(self, req: CompletionRequest, who: Principal) -> GenerateRequest:
        self.check_model(req.model)
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

    async def complete(
        self, req: CompletionRequest, who: Principal, route: RouteOverride | None = None
    ) -> Routed[Completion]:
        t0 = time.perf_counter()
        greq = self._completion_request(req, who)
        d = await self._dispatcher.route(greq, route)
        text: list[str] = []
        totals = Totals()
        async with aclosing(self._dispatcher.run(greq, d, "completions", t0, totals)) as chunks:
            async for chunk in chunks:
                text.append(chunk.text)
        body = Completion(
            id=greq.request_id,
            model=self._model,
            choices=[CompletionChoice(text="".join(text), finish_reason=totals.finish_reason)],
            usage=totals.usage(),
        )
        return Routed(body, d)

    async def complete_stream(
        self, req: CompletionRequest, who: Principal, route: RouteOverride | None = None
    ) -> Routed[AsyncGenerator[Completion, None]]:
        t0 = time.perf_counter()
        greq = self._completion_request(req, who)
        d = await self._dispatcher.route(greq, route)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def stream() -> AsyncGenerator[Completion, None]:
            totals = Totals()
            async with aclosing(self._dispatcher.run(greq, d, "completions", t0, totals)) as chunks:
                async for out in chunks:
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
                    usage=totals.usage(),
                )

        return Routed(stream(), d)

    # ---------------------------------------------------------- shared

    def check_model(self, model: str) -> None:
        if not self.ready:
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
            cache_salt=tenant_salt(who.tenant),
        )
