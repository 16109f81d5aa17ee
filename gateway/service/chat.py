"""The service core: the one request path that every edge (HTTP, gRPC) calls.

Edge validates into a typed request → tokenize with the model's template →
check limits → route to a replica (gateway/local/dispatch.py) → stream → fold usage.
Streams start the engine before yielding anything, so errors that happen
before the first token still become a proper HTTP status.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Generic, TypeVar

from engines.base import Engine, GenerateRequest, SamplingOptions
from gateway.core.config import LOCAL_TARGET
from gateway.core.errors import InvalidRequest, NotFound, Unavailable
from gateway.core.metrics import Metrics
from gateway.core.schemas import (
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
    Usage,
)
from gateway.local.dispatch import Dispatcher, Totals
from gateway.local.replicas import RouteOverride
from gateway.service.provider_chat import ProviderChat, request_config, request_parts, usage_record
from gateway.service.targets import Served, Targets, first_ok
from gateway.sessions.log import Open, SessionLog
from gateway.sessions.reconstruct import vllm_payload
from manifest.sessionlog import Header

T = TypeVar("T")


async def primed(gen: AsyncGenerator[T, None]) -> AsyncGenerator[T, None]:
    """``gen`` with its first item already produced: errors before it are raised here."""
    try:
        first = await anext(gen)
    except BaseException:
        await gen.aclose()
        raise

    async def stream() -> AsyncGenerator[T, None]:
        async with aclosing(gen):
            yield first
            async for item in gen:
                yield item

    return stream()


def tenant_salt(tenant: str) -> str:
    """vLLM's cache_salt for a tenant: tenants never share a prefix-cache span."""
    return f"tenant:{tenant}"


@dataclass(frozen=True)
class Principal:
    """Who is calling.  The tenant salts the engine's prefix cache."""

    tenant: str
    key_name: str = ""
    admin: bool = False
    global_admin: bool = False  # may act on other tenants' spans (names them or raw hashes)


@dataclass(frozen=True)
class Routed(Generic[T]):
    """A result and where it was served (for the x-vcache-* response headers)."""

    body: T
    served: Served

    def headers(self) -> dict[str, str]:
        return self.served.headers()


class GatewayService:
    def __init__(
        self,
        dispatcher: Dispatcher,
        model_name: str,
        targets: Targets | None = None,
        providers: ProviderChat | None = None,
        metrics: Metrics | None = None,
        log: SessionLog | None = None,
    ) -> None:
        self._dispatcher = dispatcher
        self._model = model_name
        self._targets = targets or Targets(model_name, {}, [])
        self.providers = providers
        self._metrics = metrics or Metrics()
        self.log = log

    @property
    def targets(self) -> Targets:
        return self._targets

    @property
    def model_name(self) -> str:
        return self._model

    @property
    def dispatcher(self) -> Dispatcher:
        return self._dispatcher

    @property
    def _engine(self) -> Engine:
        """A serving replica's engine (the first one when none serves): all replicas serve
        the same model and tokenizer."""
        d = self._dispatcher
        serving = d.serving()
        return serving[0].engine if serving else d.replicas[0].engine

    @property
    def ready(self) -> bool:
        """Started, and (unless provider-only) at least one local replica serving."""
        d = self._dispatcher
        return d.started and (not d.replicas or bool(d.serving()))

    def models(self) -> ModelList:
        if not self._dispatcher.replicas:  # a provider-only gateway
            return ModelList(data=[ModelCard(id=name) for name in self._targets.names()])
        max_len = self._engine.capabilities.max_model_len if self.ready else None
        cards = [ModelCard(id=self._model, max_model_len=max_len)]
        cards += [ModelCard(id=name) for name in self._targets.names()[1:]]
        return ModelList(data=cards)

    def chat_tokens(self, messages: list[ChatMessage]) -> list[int]:
        """Token ids of ``messages`` through the model's chat template."""
        rendered = [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in messages
        ]
        return self._engine.tokenizer.render_chat(rendered)

    def text_tokens(self, text: str) -> list[int]:
        return self._engine.tokenizer.encode(text)

    def check_token_ids(self, ids: list[int], param: str) -> list[int]:
        """Client-given token ids, each inside the model's vocabulary (else a 400): the
        larger of the tokenizer's and the model's, as vLLM's own check."""
        engine = self._engine
        vocab = max(engine.tokenizer.vocab_size, engine.capabilities.vocab_size or 0)
        for i, t in enumerate(ids):
            if not 0 <= t < vocab:
                raise InvalidRequest(
                    f"Invalid value for '{param}[{i}]': token id {t} is outside the model's "
                    f"vocabulary (0 to {vocab - 1})",
                    param=f"{param}[{i}]",
                    code="invalid_value",
                )
        return ids

    # ------------------------------------------------------------ chat

    def _chat_request(self, req: ChatCompletionRequest, who: Principal) -> GenerateRequest:
        if req.tools:
            raise InvalidRequest(
                "tools are not supported by the local model; use a hosted provider target",
                param="tools",
                code="tools_unsupported",
            )
        self.check_ready()
        ids = self.chat_tokens(req.messages)
        limit_param = "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens"
        return self._generate_request(
            "chatcmpl", ids, req, req.output_limit(), ("messages", limit_param), who
        )

    def _provider_chat(self) -> ProviderChat:
        if self.providers is None:
            raise Unavailable("no hosted providers are configured", code="no_providers")
        return self.providers

    async def chat(
        self,
        req: ChatCompletionRequest,
        who: Principal,
        route: RouteOverride | None = None,
        session: str | None = None,
    ) -> Routed[ChatCompletion]:
        """One answer from the first target of ``req.model`` that can serve it.
        ``session``: an explicit session-log session (else found or started implicitly)."""
        served = Served()

        async def attempt(target: str) -> ChatCompletion:
            if target == LOCAL_TARGET:
                return await self._chat_local(req, who, route, served, session)
            rid = f"chatcmpl-{uuid.uuid4().hex}"
            chat = self._provider_chat()
            return await chat.complete(req, who.tenant, target, served, rid, session)

        targets = self._targets.resolve(req.model)
        body = await first_ok(targets, attempt, served, self._metrics)
        return Routed(body, served)

    async def _chat_local(
        self,
        req: ChatCompletionRequest,
        who: Principal,
        route: RouteOverride | None,
        served: Served,
        session: str | None = None,
    ) -> ChatCompletion:
        with self._dispatcher.admit():
            t0 = time.perf_counter()
            greq = self._chat_request(req, who)
            d = await self._dispatcher.route(greq, route)
            served.target, served.dispatch, served.lint = LOCAL_TARGET, d, ()
            op = await self._log_local(req, who, greq, session, served)
            text: list[str] = []
            totals = Totals()
            async with aclosing(self._dispatcher.run(greq, d, "chat", t0, totals)) as chunks:
                async for chunk in chunks:
                    text.append(chunk.text)
            await self._log_answer(op, served, greq.request_id, "".join(text), totals.usage())
        return ChatCompletion(
            id=greq.request_id,
            model=req.model,
            choices=[
                ChatChoice(
                    message=AssistantMessage(content="".join(text)),
                    finish_reason=totals.finish_reason,
                )
            ],
            usage=totals.usage(),
        )

    async def chat_stream(
        self,
        req: ChatCompletionRequest,
        who: Principal,
        route: RouteOverride | None = None,
        session: str | None = None,
    ) -> Routed[AsyncGenerator[ChatCompletionChunk, None]]:
        """A stream that has produced its first chunk: every error before the first token
        (and every fallback) happens here, before a response starts."""
        served = Served()

        async def attempt(
            target: str,
        ) -> tuple[AsyncGenerator[ChatCompletionChunk, None], ChatCompletionChunk]:
            if target == LOCAL_TARGET:
                gen = self._chat_local_stream(req, who, route, served, session)
            else:
                rid = f"chatcmpl-{uuid.uuid4().hex}"
                chat = self._provider_chat()
                gen = chat.stream(req, who.tenant, target, served, rid, session)
            try:
                return gen, await anext(gen)
            except BaseException:
                await gen.aclose()
                raise

        targets = self._targets.resolve(req.model)
        inner, first = await first_ok(targets, attempt, served, self._metrics)

        async def stream() -> AsyncGenerator[ChatCompletionChunk, None]:
            async with aclosing(inner):
                yield first
                async for c in inner:
                    yield c

        return Routed(stream(), served)

    async def _chat_local_stream(
        self,
        req: ChatCompletionRequest,
        who: Principal,
        route: RouteOverride | None,
        served: Served,
        session: str | None = None,
    ) -> AsyncGenerator[ChatCompletionChunk, None]:
        with self._dispatcher.admit():
            async with aclosing(self._chat_local_admitted(req, who, route, served, session)) as s:
                async for c in s:
                    yield c

    async def _chat_local_admitted(
        self,
        req: ChatCompletionRequest,
        who: Principal,
        route: RouteOverride | None,
        served: Served,
        session: str | None,
    ) -> AsyncGenerator[ChatCompletionChunk, None]:
        t0 = time.perf_counter()
        greq = self._chat_request(req, who)
        d = await self._dispatcher.route(greq, route)
        served.target, served.dispatch, served.lint = LOCAL_TARGET, d, ()
        op = await self._log_local(req, who, greq, session, served)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(delta: ChunkDelta, finish: str | None = None) -> ChatCompletionChunk:
            return ChatCompletionChunk(
                id=greq.request_id,
                model=req.model,
                choices=[ChunkChoice(delta=delta, finish_reason=finish)],
            )

        totals = Totals()
        first = True
        text: list[str] = []
        async with aclosing(self._dispatcher.run(greq, d, "chat", t0, totals)) as chunks:
            async for out in chunks:
                if first:  # the engine accepted the request: now the stream may begin
                    yield chunk(ChunkDelta(role="assistant", content=""))
                    first = False
                if out.text:
                    text.append(out.text)
                    yield chunk(ChunkDelta(content=out.text))
        await self._log_answer(op, served, greq.request_id, "".join(text), totals.usage())
        yield chunk(ChunkDelta(), totals.finish_reason)
        if include_usage:
            yield ChatCompletionChunk(
                id=greq.request_id, model=req.model, choices=[], usage=totals.usage()
            )

    async def _log_local(
        self,
        req: ChatCompletionRequest,
        who: Principal,
        greq: GenerateRequest,
        session: str | None,
        served: Served,
    ) -> Open | None:
        """Log a local request before it reaches the engine (token ids, salt, sampling)."""
        if self.log is None:
            return None
        system, turns = request_parts(req)
        header = Header.make(req.model, LOCAL_TARGET, system, None, request_config(req, None))
        op = self.log.open(who.tenant, header, turns, session)
        sampling = dataclasses.asdict(greq.sampling)
        sent = vllm_payload(greq.prompt_token_ids, greq.cache_salt, sampling)
        directives = {"cache_salt": greq.cache_salt, "sampling": sampling}
        await self.log.dispatch(op, greq.request_id, LOCAL_TARGET, "vllm", directives, sent)
        served.session = op.session_id
        return op

    async def _log_answer(
        self, op: Open | None, served: Served, rid: str, text: str, usage: Usage
    ) -> None:
        if self.log is not None and op is not None:
            await self.log.respond(op, rid, text, usage_record(usage))
            served.answer_seq = op.answer_seq

    # ------------------------------------------------------- completions

    def _completion_request(self, req: CompletionRequest, who: Principal) -> GenerateRequest:
        if LOCAL_TARGET not in self._targets.resolve(req.model):
            raise InvalidRequest(
                f"'{req.model}' is served by hosted providers only; text completions are "
                "served by the local model",
                param="model",
                code="unsupported_model",
            )
        self.check_ready()
        p, param = req.prompt, "prompt"
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list):
            p, param = p[0], "prompt[0]"
        tok = self._engine.tokenizer
        ids = tok.encode(p) if isinstance(p, str) else self.check_token_ids(p, param)  # type: ignore[arg-type]
        if not ids:
            raise InvalidRequest("prompt must not be empty", param="prompt", code="invalid_value")
        return self._generate_request(
            "cmpl", ids, req, req.max_tokens, ("prompt", "max_tokens"), who
        )

    async def complete(
        self, req: CompletionRequest, who: Principal, route: RouteOverride | None = None
    ) -> Routed[Completion]:
        with self._dispatcher.admit():
            t0 = time.perf_counter()
            greq = self._completion_request(req, who)
            d = await self._dispatcher.route(greq, route)
            text: list[str] = []
            totals = Totals()
            async with aclosing(self._dispatcher.run(greq, d, "completions", t0, totals)) as cs:
                async for chunk in cs:
                    text.append(chunk.text)
        body = Completion(
            id=greq.request_id,
            model=self._model,
            choices=[CompletionChoice(text="".join(text), finish_reason=totals.finish_reason)],
            usage=totals.usage(),
        )
        return Routed(body, Served(dispatch=d))

    async def complete_stream(
        self, req: CompletionRequest, who: Principal, route: RouteOverride | None = None
    ) -> Routed[AsyncGenerator[Completion, None]]:
        """A stream that has produced its first chunk (errors before it are raised here)."""
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        served = Served()

        async def stream() -> AsyncGenerator[Completion, None]:
            with self._dispatcher.admit():
                t0 = time.perf_counter()
                greq = self._completion_request(req, who)
                served.dispatch = d = await self._dispatcher.route(greq, route)
                totals = Totals()
                async with aclosing(self._dispatcher.run(greq, d, "completions", t0, totals)) as cs:
                    async for out in cs:
                        choice = CompletionChoice(text=out.text, finish_reason=out.finish_reason)
                        yield Completion(id=greq.request_id, model=self._model, choices=[choice])
            if include_usage:
                yield Completion(
                    id=greq.request_id, model=self._model, choices=[], usage=totals.usage()
                )

        return Routed(await primed(stream()), served)

    # ---------------------------------------------------------- shared

    def check_ready(self) -> None:
        if self._dispatcher.failed is not None:
            raise Unavailable("the local engine failed to start", code="engine_failed")
        if not self._dispatcher.started:
            raise Unavailable(
                "the engine is still starting", code="engine_starting", retry_after_s=5
            )
        if not self.ready:
            raise Unavailable(
                "the local engine is not running; it is being restarted",
                code="engine_unavailable",
                retry_after_s=self._dispatcher.retry_after_s(),
            )

    def check_model(self, model: str) -> None:
        self.check_ready()
        if model != self._model or not self._dispatcher.replicas:
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
