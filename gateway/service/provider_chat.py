"""Chat completions served by a hosted provider, in OpenAI's shapes.

:func:`request_parts` and :func:`provider_call` turn the OpenAI request into a
provider-neutral :class:`~engines.providers.base.ChatCall` (the same function
renders it again from the session log): leading system/developer messages
become the system prompt; the prefix lint runs over it, and under the
``canonical`` layout the lines it flags (dates, times, ids) move to a
volatile part rendered after the stable one, so the stable part stays a
cacheable anchor.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from engines.errors import EngineError
from engines.providers.base import (
    CacheDirectives,
    ChatCall,
    Delta,
    ProviderUsage,
    Rendered,
    Turn,
)
from gateway.core.errors import from_engine_error
from gateway.core.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChunkChoice,
    ChunkDelta,
    Usage,
)
from gateway.providers.path import BeforeSend, Outcome, ProviderPath
from gateway.service.targets import Served
from manifest.canonical import canonicalize, lint, split_volatile
from manifest.sessionlog import Header, MessageEvent

if TYPE_CHECKING:
    from gateway.sessions.log import Open, SessionLog


def request_parts(
    req: ChatCompletionRequest,
) -> tuple[tuple[str, ...], tuple[MessageEvent, ...]]:
    """Leading system/developer messages (the system prompt) and the turns after them."""
    msgs = list(req.messages)
    lead = 0
    while lead < len(msgs) and msgs[lead].role in ("system", "developer"):
        lead += 1
    system = tuple(m.text() for m in msgs[:lead])
    turns = tuple(MessageEvent(m.role, m.text(), m.name) for m in msgs[lead:])
    return system, turns


def request_config(req: ChatCompletionRequest, layout: str | None) -> dict[str, Any]:
    """The call config a header snapshot keeps (what frames the request, not the turns)."""
    return {
        "max_tokens": req.output_limit(),
        "temperature": req.temperature,
        "top_p": req.top_p,
        "stop": list(req.stop_list()),
        "seed": req.seed,
        "stream": req.stream,
        "layout": layout,
        "tool_choice": req.tool_choice,
    }


def provider_call(header: Header, turns: Sequence[MessageEvent]) -> tuple[ChatCall, list[str]]:
    """The provider-neutral call a header and turns render to (live and when rebuilt).

    The system prompts are joined; the prefix lint runs over them and, under
    the ``canonical`` layout, the lines it flags move to a volatile part.
    """
    cfg = header.settings()
    system = "\n\n".join(header.system) or None
    findings = lint(canonicalize([], system=system)) if system else []
    named = [f"{f.rule}@{f.segment_key}+{f.byte_offset}" for f in findings]
    volatile = None
    if system and findings and cfg.get("layout") == "canonical":
        stable, volatile = split_volatile(system)
        system = stable or None
        volatile = volatile or None
    call = ChatCall(
        model=header.target.partition("/")[2],
        turns=tuple(
            Turn("assistant", m.content)
            if m.role == "assistant"
            else Turn("user", m.content if m.role == "user" else f"[{m.role}] {m.content}")
            for m in turns
        ),
        system=system,
        volatile_system=volatile,
        tools=tuple(header.tool_list()),
        tool_choice=cfg.get("tool_choice"),
        max_tokens=cfg.get("max_tokens"),
        temperature=cfg.get("temperature"),
        top_p=cfg.get("top_p"),
        stop=tuple(cfg.get("stop") or ()),
        seed=cfg.get("seed"),
        stream=bool(cfg.get("stream", False)),
    )
    return call, named


def directives_of(d: CacheDirectives) -> dict[str, Any]:
    """The cache directives a dispatch event keeps (what the request was rendered with)."""
    return {
        "breakpoints": list(d.breakpoints),
        "ttl_s": d.ttl_s,
        "cache_key": d.cache_key,
        "cached_content": d.cached_content,
        "warm": d.warm,
    }


def usage_of(u: ProviderUsage | None) -> Usage:
    if u is None:
        return Usage.of(0, 0, 0)
    return Usage.of(u.prompt_tokens, u.completion_tokens, u.cached_tokens, u.cache_write_tokens)


class ProviderChat:
    def __init__(self, path: ProviderPath, layout: str, log: SessionLog | None = None) -> None:
        self.path = path
        self.layout = layout
        self.log = log

    def _prepare(
        self,
        req: ChatCompletionRequest,
        target: str,
        served: Served,
        tenant: str,
        session: str | None,
    ) -> tuple[ChatCall, Open | None]:
        self.path.target(target)  # 404 / 503 before anything else
        system, turns = request_parts(req)
        config = request_config(req, self.layout)
        header = Header.make(req.model, target, system, req.tool_dicts(), config)
        call, lint_names = provider_call(header, turns)
        served.target, served.dispatch, served.lint = target, None, tuple(lint_names)
        op = self.log.open(tenant, header, turns, session) if self.log else None
        return call, op

    def _hook(self, op: Open | None, rid: str, target: str) -> BeforeSend | None:
        log = self.log
        if log is None or op is None:
            return None

        async def before_send(r: Rendered, d: CacheDirectives, attempt: int) -> None:
            request_id = rid if attempt == 0 else f"{rid}-{attempt}"
            await log.dispatch(op, request_id, target, "provider", directives_of(d), r.body)

        return before_send

    async def _deltas(
        self, call: ChatCall, op: Open | None, tenant: str, target: str, rid: str, out: Outcome
    ) -> AsyncGenerator[Delta, None]:
        """The provider's deltas for ``call``, logged before sending, errors in the API's terms."""
        try:
            stream = self.path.stream(
                self.path.target(target), call, tenant, rid, out,
                before_send=self._hook(op, rid, target),
            )  # fmt: skip
            async with aclosing(stream) as deltas:
                async for d in deltas:
                    yield d
        except EngineError as exc:
            raise from_engine_error(exc) from exc

    async def _respond(
        self, op: Open | None, rid: str, text: str, usage: Usage, served: Served | None = None
    ) -> None:
        if self.log is not None and op is not None:
            await self.log.respond(op, rid, text, usage_record(usage))
            if served is not None:
                served.answer_seq = op.answer_seq

    async def warm(
        self, req: ChatCompletionRequest, tenant: str, target: str, rid: str
    ) -> ProviderUsage | None:
        """A warm of ``req``'s anchors, logged like any request that reaches a model."""
        req = req.model_copy(update={"max_tokens": 1, "stream": False})
        call, op = self._prepare(req, target, Served(), tenant, None)
        try:
            out = await self.path.warm(
                self.path.target(target), call, tenant, rid, self._hook(op, rid, target)
            )
        except EngineError as exc:
            raise from_engine_error(exc) from exc
        await self._respond(op, rid, "", usage_of(out.usage))
        return out.usage

    async def complete(
        self,
        req: ChatCompletionRequest,
        tenant: str,
        target: str,
        served: Served,
        rid: str,
        session: str | None = None,
    ) -> ChatCompletion:
        call, op = self._prepare(req, target, served, tenant, session)
        out = Outcome()
        text: list[str] = []
        finish = "stop"
        async with aclosing(self._deltas(call, op, tenant, target, rid, out)) as deltas:
            async for d in deltas:
                text.append(d.text)
                finish = d.finish_reason or finish
        usage = usage_of(out.usage)
        served.session = op.session_id if op else None
        await self._respond(op, rid, "".join(text), usage, served)
        return ChatCompletion(
            id=rid,
            model=req.model,
            choices=[
                ChatChoice(message=AssistantMessage(content="".join(text)), finish_reason=finish)
            ],
            usage=usage,
        )

    async def stream(
        self,
        req: ChatCompletionRequest,
        tenant: str,
        target: str,
        served: Served,
        rid: str,
        session: str | None = None,
    ) -> AsyncGenerator[ChatCompletionChunk, None]:
        call, op = self._prepare(req, target, served, tenant, session)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        created = int(time.time())

        def chunk(delta: ChunkDelta, finish: str | None = None) -> ChatCompletionChunk:
            return ChatCompletionChunk(
                id=rid,
                created=created,
                model=req.model,
                choices=[ChunkChoice(delta=delta, finish_reason=finish)],
            )

        out = Outcome()
        first, finish = True, "stop"
        text: list[str] = []
        async with aclosing(self._deltas(call, op, tenant, target, rid, out)) as deltas:
            async for d in deltas:
                if first:
                    served.session = op.session_id if op else None
                    yield chunk(ChunkDelta(role="assistant", content=""))
                    first = False
                if d.text:
                    text.append(d.text)
                    yield chunk(ChunkDelta(content=d.text))
                finish = d.finish_reason or finish
        usage = usage_of(out.usage)
        await self._respond(op, rid, "".join(text), usage, served)
        yield chunk(ChunkDelta(), finish)
        if include_usage:
            yield ChatCompletionChunk(
                id=rid, created=created, model=req.model, choices=[], usage=usage
            )


def usage_record(u: Usage) -> dict[str, Any]:
    """What a response event keeps of an answer's usage."""
    d = u.prompt_tokens_details
    return {
        "prompt_tokens": u.prompt_tokens,
        "cached_tokens": d.cached_tokens,
        "cache_write_tokens": d.cache_write_tokens or 0,
        "completion_tokens": u.completion_tokens,
    }
