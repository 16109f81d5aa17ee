"""Chat completions served by a hosted provider, in OpenAI's shapes.

:func:`chat_call` turns the OpenAI request into a provider-neutral
:class:`~engines.providers.base.ChatCall`: leading system/developer messages
become the system prompt; the prefix lint runs over it, and under the
``canonical`` layout the lines it flags (dates, times, ids) move to a
volatile part rendered after the stable one, so the stable part stays a
cacheable anchor.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from contextlib import aclosing

from engines.errors import EngineError
from engines.providers.base import ChatCall, ProviderUsage, Turn
from gateway.errors import from_engine_error
from gateway.fallback import Served
from gateway.providers import Outcome, ProviderPath
from gateway.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChunkChoice,
    ChunkDelta,
    Usage,
)
from manifest.canonical import canonicalize, lint, split_volatile


def chat_call(req: ChatCompletionRequest, model: str, layout: str) -> tuple[ChatCall, list[str]]:
    msgs = list(req.messages)
    lead = 0
    while lead < len(msgs) and msgs[lead].role in ("system", "developer"):
        lead += 1
    system = "\n\n".join(m.text() for m in msgs[:lead]) or None
    turns = tuple(
        Turn("assistant", m.text())
        if m.role == "assistant"
        else Turn("user", m.text() if m.role == "user" else f"[{m.role}] {m.text()}")
        for m in msgs[lead:]
    )
    findings = lint(canonicalize([], system=system)) if system else []
    named = [f"{f.rule}@{f.segment_key}+{f.byte_offset}" for f in findings]
    volatile = None
    if system and findings and layout == "canonical":
        stable, volatile = split_volatile(system)
        system = stable or None
        volatile = volatile or None
    call = ChatCall(
        model=model,
        turns=turns,
        system=system,
        volatile_system=volatile,
        max_tokens=req.output_limit(),
        temperature=req.temperature,
        top_p=req.top_p,
        stop=req.stop_list(),
        seed=req.seed,
        stream=req.stream,
    )
    return call, named


def usage_of(u: ProviderUsage | None) -> Usage:
    if u is None:
        return Usage.of(0, 0, 0)
    return Usage.of(u.prompt_tokens, u.completion_tokens, u.cached_tokens, u.cache_write_tokens)


class ProviderChat:
    def __init__(self, path: ProviderPath, layout: str) -> None:
        self.path = path
        self.layout = layout

    def _prepare(
        self, req: ChatCompletionRequest, target: str, served: Served
    ) -> tuple[ChatCall, str]:
        t = self.path.target(target)
        call, lint_names = chat_call(req, t.model, self.layout)
        served.target, served.dispatch, served.lint = target, None, tuple(lint_names)
        return call, target

    async def complete(
        self, req: ChatCompletionRequest, tenant: str, target: str, served: Served, rid: str
    ) -> ChatCompletion:
        call, name = self._prepare(req, target, served)
        out = Outcome()
        text: list[str] = []
        finish = "stop"
        try:
            stream = self.path.stream(self.path.target(name), call, tenant, rid, out)
            async with aclosing(stream) as deltas:
                async for d in deltas:
                    text.append(d.text)
                    finish = d.finish_reason or finish
        except EngineError as exc:
            raise from_engine_error(exc) from exc
        return ChatCompletion(
            id=rid,
            model=req.model,
            choices=[
                ChatChoice(message=AssistantMessage(content="".join(text)), finish_reason=finish)
            ],
            usage=usage_of(out.usage),
        )

    async def stream(
        self, req: ChatCompletionRequest, tenant: str, target: str, served: Served, rid: str
    ) -> AsyncGenerator[ChatCompletionChunk, None]:
        call, name = self._prepare(req, target, served)
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
        try:
            stream = self.path.stream(self.path.target(name), call, tenant, rid, out)
            async with aclosing(stream) as deltas:
                async for d in deltas:
                    if first:
                        yield chunk(ChunkDelta(role="assistant", content=""))
                        first = False
                    if d.text:
                        yield chunk(ChunkDelta(content=d.text))
                    finish = d.finish_reason or finish
        except EngineError as exc:
            raise from_engine_error(exc) from exc
        yield chunk(ChunkDelta(), finish)
        if include_usage:
            yield ChatCompletionChunk(
                id=rid, created=created, model=req.model, choices=[], usage=usage_of(out.usage)
            )
