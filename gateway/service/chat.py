"""The service core: the one request path every edge (HTTP, gRPC) calls.

A chat request names a model; :class:`~gateway.service.targets.Targets`
resolves it to ordered targets (the local replicas, hosted providers) and the
first that can serve it answers, through the one loop every target shares
(:mod:`gateway.service.loop`: admit, prepare, journal, acquire, send, settle,
release).  A text completion goes through the same loop over the targets that
serve text (the local replicas: :mod:`gateway.service.local_completions`),
one engine request per prompt; so does the local cache warm
(:meth:`GatewayService.warm_local`).
The service is built from its parts (:class:`ServiceParts`: the local chat,
the loops and their journal, the model catalog, the limits), each built once by the composition
root, ``gateway/app.py``.
Each path produces answer pieces (:mod:`gateway.core.shaping`); they are
shaped once into the API's objects.  Streams produce their first piece before
returning, so every error before the first token (and every fallback) happens
before a response starts.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import TypeVar

from gateway.core.completion_request import CompletionRequest
from gateway.core.config import LOCAL_TARGET
from gateway.core.errors import InvalidRequest, RateLimited
from gateway.core.metrics import Metrics
from gateway.core.outputs import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    ModelCard,
    ModelList,
    Usage,
)
from gateway.core.pieces import Answer, Pieces, primed
from gateway.core.schemas import (
    ChatCompletionRequest,
    SamplingFields,
)
from gateway.core.shaping import Shape, chat_chunks, chat_completion, completion, completion_chunks
from gateway.core.target import Call
from gateway.core.tracing import RequestTrace, Tracing
from gateway.core.types import Principal, Routed, RouteOverride, Served
from gateway.local.dispatch import Dispatcher
from gateway.local.routing import POLICIES
from gateway.service.catalog import ModelCatalog
from gateway.service.limits import Grant, RateLimits
from gateway.service.local import LocalChat
from gateway.service.local_completions import LocalCompletions, prompt_calls
from gateway.service.loop import ServiceLoop
from gateway.service.provider_chat import ProviderChat
from gateway.service.targets import Targets
from gateway.sessions.log import SessionLog

T = TypeVar("T")
R = TypeVar("R", bound=SamplingFields)


def _shape(req: SamplingFields, n: int, logprobs: bool, prompt_logprobs: bool) -> Shape:
    options = req.stream_options
    return Shape(
        n=n,
        logprobs=logprobs,
        include_usage=bool(options and options.include_usage),
        token_ids=bool(req.return_token_ids),
        prompt_logprobs=prompt_logprobs,
        as_token_ids=req.return_tokens_as_token_ids,
        # vLLM's: the running usage rides on the chunks only when a usage is asked for
        continuous_usage=bool(options and options.include_usage and options.continuous_usage_stats),
    )


def chat_shape(req: ChatCompletionRequest) -> Shape:
    shape = _shape(req, req.n, bool(req.logprobs), req.prompt_logprobs is not None)
    return dataclasses.replace(shape, echo=req.echoed())


def completion_shape(req: CompletionRequest) -> Shape:
    asked = req.prompt_logprobs_asked() is not None
    return _shape(req, req.n * req.prompt_count(), req.logprobs is not None, asked)


def _usage_attrs(u: Usage) -> dict[str, int]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "cached_tokens": u.prompt_tokens_details.cached_tokens,
        "completion_tokens": u.completion_tokens,
    }


async def _ended(
    pieces: Pieces, trace: RequestTrace, served: Served, grant: Grant | None
) -> Pieces:
    """``pieces``; when the answer ends (or the client leaves), in one ``finally``: the
    request's span ends, and the key's slot is freed with its tokens counted (a key
    without limits: nothing to free)."""
    usage: Usage | None = None
    error: BaseException | None = None
    try:
        async with aclosing(pieces):
            async for p in pieces:
                if p.usage is not None:
                    usage = p.usage
                yield p
    except BaseException as exc:
        error = exc
        raise
    finally:
        trace.end(error, target=served.target, **(_usage_attrs(usage) if usage else {}))
        _release(grant, usage.total_tokens if usage is not None else 0)


@dataclass(frozen=True)
class ServiceParts:
    """What the service is built from, each built once by the composition root
    (``gateway/app.py``): the loops over the chat targets (``loop``, over
    :func:`~gateway.service.catalog.chat_targets`) and the text targets (``text_loop``,
    over :func:`~gateway.service.catalog.text_targets`) share one journal over ``log``;
    ``catalog`` names the models served and a model's targets."""

    local: LocalChat
    completions: LocalCompletions
    loop: ServiceLoop
    text_loop: ServiceLoop
    catalog: ModelCatalog
    limits: RateLimits
    metrics: Metrics
    tracing: Tracing
    providers: ProviderChat | None = None
    log: SessionLog | None = None


class GatewayService:
    """The one request path every edge calls (see the module); what models it serves and
    a model's targets are its :class:`~gateway.service.catalog.ModelCatalog`'s."""

    def __init__(self, parts: ServiceParts) -> None:
        self.local = parts.local
        self.completions = parts.completions
        self.loop = parts.loop
        self.text_loop = parts.text_loop  # the same loop over the targets of text prompts
        self.catalog = parts.catalog
        self.limits = parts.limits
        self._metrics = parts.metrics
        self.tracing = parts.tracing
        self.providers = parts.providers
        self.log = parts.log

    @property
    def targets(self) -> Targets:
        return self.catalog.targets

    @property
    def model_name(self) -> str:
        return self.catalog.model_name

    @property
    def dispatcher(self) -> Dispatcher:
        return self.local.dispatcher

    @property
    def routing_policies(self) -> list[str]:
        return list(POLICIES)

    @property
    def ready(self) -> bool:
        return self.local.ready

    def models(self) -> ModelList:
        return self.catalog.models()

    def model(self, model_id: str) -> ModelCard:
        return self.catalog.model(model_id)

    def check_model(self, model: str) -> None:
        """``model`` is the local model and it can serve now."""
        self.catalog.check_model(model)

    def check_token_ids(self, ids: list[int], param: str) -> list[int]:
        return self.local.check_token_ids(ids, param)

    def resolve(self, model: str) -> list[str]:
        """The targets of ``model`` (:meth:`~gateway.service.catalog.ModelCatalog.resolve`)."""
        return self.catalog.resolve(model)

    def close(self) -> None:
        """Stop the local path's render thread."""
        self.local.close()

    # ------------------------------------------------------------ chat

    def named(self, req: R) -> R:
        """``req`` naming a model: as sent, or (left out, as vLLM allows) the local one."""
        if req.model:
            return req
        local = self.catalog.targets.local
        if local is None:
            raise InvalidRequest(
                "Missing required parameter: 'model' (no local model to default to)",
                param="model",
                code="missing_required_parameter",
            )
        return req.model_copy(update={"model": local})

    def _admit(self, who: Principal) -> Grant | None:
        """The key's limits, first: a request over one is a 429 before any work."""
        try:
            return self.limits.admit(who)
        except RateLimited:
            self._metrics.rate_limited.labels(who.tenant, who.key_name).inc()
            raise

    def _call(
        self,
        req: ChatCompletionRequest,
        who: Principal,
        route: RouteOverride | None,
        session: str | None,
        trace: RequestTrace,
    ) -> Call:
        return Call(req, who, f"chatcmpl-{uuid.uuid4().hex}", session, route, trace)

    async def answer(
        self,
        req: ChatCompletionRequest,
        who: Principal,
        route: RouteOverride | None = None,
        session: str | None = None,
    ) -> Routed[Answer]:
        """The answer of the first target of ``req.model`` that can serve it, its first
        piece produced.  ``session``: an explicit session-log session (else found or
        started implicitly)."""
        grant = self._admit(who)
        trace = self.tracing.request("vcache.chat", model=req.model, stream=True)
        try:
            await self.local.learn_adapters()
            names = self.resolve(req.model)
            call = self._call(req, who, route, session, trace)
            routed = await self.loop.first_answer(names, call, limits=_headers(grant))
        except BaseException as exc:
            trace.end(exc)
            _release(grant, 0)
            raise
        a, served = routed.body, routed.served
        # started here, so its finally (the span's end, the key's slot) runs however
        # the stream ends, even one never read
        pieces = await primed(_ended(a.pieces, trace, served, grant))
        return Routed(Answer(a.id, pieces), served)

    async def chat(
        self,
        req: ChatCompletionRequest,
        who: Principal,
        route: RouteOverride | None = None,
        session: str | None = None,
    ) -> Routed[ChatCompletion]:
        """One whole answer; a target that fails at any point before it ends falls back."""
        req = self.named(req)

        async def shape(rid: str, pieces: Pieces) -> ChatCompletion:
            return await chat_completion(rid, req.model, pieces, chat_shape(req))

        routed = await self.whole(req, who, shape, route, session)
        return Routed(routed.body[0], routed.served)

    async def whole(
        self,
        req: ChatCompletionRequest,
        who: Principal,
        shape: Callable[[str, Pieces], Awaitable[T]],
        route: RouteOverride | None = None,
        session: str | None = None,
    ) -> Routed[tuple[T, Usage]]:
        """One whole answer shaped by ``shape(request id, pieces)`` (any API's object) and
        its usage; a target that fails at any point before it ends falls back."""
        grant = self._admit(who)
        trace = self.tracing.request("vcache.chat", model=req.model, stream=False)
        usage = Usage.of(0, 0, 0)

        async def used(pieces: Pieces) -> Pieces:
            nonlocal usage
            async with aclosing(pieces):
                async for p in pieces:
                    usage = p.usage or usage
                    yield p

        try:
            await self.local.learn_adapters()
            names = self.resolve(req.model)
            call = self._call(req, who, route, session, trace)
            routed = await self.loop.first_answer(names, call, True, _headers(grant))
            body = await shape(routed.body.id, used(routed.body.pieces))
        except BaseException as exc:
            trace.end(exc)
            raise
        finally:
            _release(grant, usage.total_tokens)
        trace.end(None, target=routed.served.target, **_usage_attrs(usage))
        return Routed((body, usage), routed.served)

    async def warm_local(self, call: Call) -> tuple[Served, Usage, tuple[int, ...]]:
        """Prefill ``call``'s prompt (a chat's messages, or a text prompt: one token
        generated, discarded) on the local replicas, through the loop as any request:
        admitted, prepared, journaled, routed over the serving replicas (a forced one
        aside), through the replica's fair gate; where it went, its usage, and the
        prompt's token ids as the engine took them."""
        loop = self.loop if isinstance(call.request, ChatCompletionRequest) else self.text_loop
        usage = Usage.of(0, 0, 0)
        ids: tuple[int, ...] = ()
        routed = loop.serve(LOCAL_TARGET, call)
        async with aclosing(routed.body) as pieces:
            async for p in pieces:
                ids = p.prompt_token_ids or ids
                usage = p.usage or usage
        return routed.served, usage, ids

    async def warm_provider(
        self, req: ChatCompletionRequest, tenant: str, target: str, rid: str
    ) -> Usage:
        """Prefill a provider's planned breakpoints without generating (Anthropic
        ``max_tokens: 0``); on implicit providers the first real request warms, so this
        sends a one-token call.  Journaled like any request that reaches a model."""
        req = req.model_copy(update={"max_tokens": 1, "stream": False})
        call = Call(req, Principal(tenant=tenant), rid, warm=True)
        usage = Usage.of(0, 0, 0)
        async with aclosing(self.loop.serve(target, call).body) as pieces:
            async for p in pieces:
                usage = p.usage or usage
        return usage

    async def chat_stream(
        self,
        req: ChatCompletionRequest,
        who: Principal,
        route: RouteOverride | None = None,
        session: str | None = None,
    ) -> Routed[AsyncGenerator[list[ChatCompletionChunk], None]]:
        req = self.named(req)
        routed = await self.answer(req, who, route, session)
        a = routed.body
        return Routed(chat_chunks(a.id, req.model, a.pieces, chat_shape(req)), routed.served)

    # ------------------------------------------------------- completions

    def local_only(self, model: str, what: str = "text completions") -> None:
        """``model`` has the local model among its targets (else a 400 saying ``what`` is
        served by the local model only)."""
        self.catalog.local_targets(model, what)

    async def _text_answer(
        self, req: CompletionRequest, who: Principal, route: RouteOverride | None, whole: bool
    ) -> Routed[tuple[str, Pieces]]:
        """A text completion's request id and answer, its first piece produced (read to
        its end first when ``whole``): each prompt an engine request through the loop
        (:meth:`~gateway.service.loop.ServiceLoop.first_answer_each`), their answers
        merged (and echoed) into the request's."""
        await self.local.learn_adapters()
        names = self.catalog.local_targets(req.model)
        grant = self._admit(who)
        trace = self.tracing.request("vcache.completion", model=req.model, stream=not whole)
        try:
            calls = prompt_calls(req, who, f"cmpl-{uuid.uuid4().hex}", route, trace)
            join = self.completions.join(req)
            loop = self.text_loop
            routed = await loop.first_answer_each(names, calls, join, whole, _headers(grant))
        except BaseException as exc:
            trace.end(exc)
            _release(grant, 0)
            raise
        a, served = routed.body, routed.served
        return Routed((a.id, _ended(a.pieces, trace, served, grant)), served)

    async def complete(
        self, req: CompletionRequest, who: Principal, route: RouteOverride | None = None
    ) -> Routed[Completion]:
        req = self.named(req)
        routed = await self._text_answer(req, who, route, whole=True)
        rid, pieces = routed.body
        body = await completion(rid, self.catalog.served(req.model), pieces, completion_shape(req))
        return Routed(body, routed.served)

    async def complete_stream(
        self, req: CompletionRequest, who: Principal, route: RouteOverride | None = None
    ) -> Routed[AsyncGenerator[list[Completion], None]]:
        """A stream that has produced its first piece (errors before it are raised here)."""
        req = self.named(req)
        routed = await self._text_answer(req, who, route, whole=False)
        rid, pieces = routed.body
        shape = completion_shape(req)
        chunks = completion_chunks(rid, self.catalog.served(req.model), pieces, shape)
        return Routed(chunks, routed.served)


def _release(grant: Grant | None, tokens: int) -> None:
    if grant is not None:
        grant.done(tokens)


def _headers(grant: Grant | None) -> dict[str, str]:
    """The key's x-ratelimit-* headers (none without limits)."""
    return grant.headers() if grant is not None else {}
