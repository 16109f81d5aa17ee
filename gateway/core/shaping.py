"""One answer shape, shaped once per API at the edge.

Every path (the local engine, a hosted provider) produces an answer as a
stream of :class:`Piece`: text as it is generated (with its token logprobs
when asked for, and the index of its sample when ``n > 1``), the finish
reason on the piece that ends a sample, and a last piece that carries only
the usage.  The functions here turn that stream into OpenAI's chat
completion (whole or as chunks) and text completion (whole or as chunks);
the gRPC edge and the Responses API read the same pieces.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from engines.base import TokenLogprob
from engines.providers.base import ThinkingPart
from gateway.core.logprob_shapes import chat_logprobs, completion_logprobs, prompt_logprobs
from gateway.core.outputs import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChunkChoice,
    ChunkDelta,
    Completion,
    CompletionChoice,
    FunctionCallOut,
    FunctionDeltaOut,
    ToolCallDeltaOut,
    ToolCallOut,
    Usage,
)

T = TypeVar("T")
Pieces = AsyncGenerator["Piece", None]


@dataclass(frozen=True)
class ToolCallDelta:
    """Part of a tool call: the first part of call ``index`` names it; ``arguments``
    (JSON text) may come in several parts."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class Piece:
    """A piece of an answer: generated text of sample ``index``, the finish reason once
    that sample ends, or (last) the usage of the whole answer."""

    text: str = ""
    finish_reason: str | None = None
    usage: Usage | None = None
    index: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()
    tool_calls: tuple[ToolCallDelta, ...] = ()
    # on the first piece, where the engine knows them then: the prompt's tokens and how
    # many were served from the prefix cache (the usage at the end is the answer's total)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    thinking: tuple[ThinkingPart, ...] = ()  # a provider's thinking blocks, relayed as written
    stop_sequence: str | None = None  # with finish "stop": the stop string that ended it
    token_ids: tuple[int, ...] = ()  # the output tokens of this piece (the engine's)
    prompt_token_ids: tuple[int, ...] | None = None  # on a choice's first, where asked
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None  # first, where asked


@dataclass(frozen=True)
class Shape:
    """What the client asked the answer to carry."""

    n: int = 1
    logprobs: bool = False
    include_usage: bool = False
    token_ids: bool = False  # vLLM's return_token_ids
    prompt_logprobs: bool = False  # vLLM's
    as_token_ids: bool = False  # vLLM's return_tokens_as_token_ids
    # vLLM's stream_options.continuous_usage_stats (only ever with include_usage)
    continuous_usage: bool = False
    echo: str = ""  # vLLM's chat echo: each choice's content starts with this


class _Running:
    """Each choice's usage so far, for a stream's every chunk (vLLM's continuous usage
    stats): its prompt (known at its first piece) and the tokens generated."""

    def __init__(self, on: bool) -> None:
        self.on = on
        self._prompt: dict[int, tuple[int, int]] = {}
        self._out: dict[int, int] = {}

    def start(self, p: Piece) -> None:
        """``p``'s prompt counts, where it carries them (a choice's first piece)."""
        if self.on and p.prompt_tokens is not None:
            self._prompt[p.index] = (p.prompt_tokens, p.cached_tokens or 0)

    def see(self, p: Piece) -> None:
        if self.on:
            self.start(p)
            self._out[p.index] = self._out.get(p.index, 0) + len(p.token_ids)

    def now(self, index: int) -> Usage | None:
        if not self.on:
            return None
        prompt, cached = self._prompt.get(index, (0, 0))
        return Usage.of(prompt, self._out.get(index, 0), cached)


class _Primed(AsyncGenerator[T, None]):
    """An async generator whose first item was produced already (``primed``): closing it
    closes the one underneath, even before that first item was read."""

    def __init__(self, first: T, gen: AsyncGenerator[T, None]) -> None:
        self._first: list[T] = [first]
        self._gen = gen

    async def asend(self, value: None) -> T:
        if self._first:
            return self._first.pop()
        return await self._gen.asend(value)

    async def athrow(self, typ: Any, val: Any = None, tb: Any = None) -> T:
        self._first.clear()
        return await self._gen.athrow(typ, val, tb)

    async def aclose(self) -> None:
        self._first.clear()
        await self._gen.aclose()


async def primed(gen: AsyncGenerator[T, None]) -> AsyncGenerator[T, None]:
    """``gen`` with its first item already produced: errors before it are raised here,
    before a streamed response has started."""
    try:
        first = await anext(gen)
    except BaseException:
        await gen.aclose()
        raise
    return _Primed(first, gen)


@dataclass
class _Call:
    """One tool call as its deltas arrive."""

    id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)


@dataclass
class _Thought:
    text: list[str] = field(default_factory=list)
    signature: list[str] = field(default_factory=list)
    redacted: str | None = None

    def block(self) -> dict[str, Any]:
        if self.redacted is not None:
            return {"type": "redacted_thinking", "data": self.redacted}
        return {
            "type": "thinking",
            "thinking": "".join(self.text),
            "signature": "".join(self.signature),
        }


@dataclass
class Sample:
    """One sample of an answer, as its pieces arrive."""

    text: list[str] = field(default_factory=list)
    finish_reason: str = "stop"
    logprobs: list[TokenLogprob] = field(default_factory=list)
    calls: dict[int, _Call] = field(default_factory=dict)
    thoughts: dict[int, _Thought] = field(default_factory=dict)
    stop_sequence: str | None = None
    token_ids: tuple[int, ...] = ()
    prompt_token_ids: tuple[int, ...] | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None

    def add(self, p: Piece) -> None:
        self.stop_sequence = p.stop_sequence or self.stop_sequence
        self.text.append(p.text)
        self.token_ids += p.token_ids
        if p.prompt_token_ids is not None:
            self.prompt_token_ids = p.prompt_token_ids
        if p.prompt_logprobs is not None:
            self.prompt_logprobs = p.prompt_logprobs
        self.logprobs += p.logprobs
        self.finish_reason = p.finish_reason or self.finish_reason
        for t in p.thinking:
            thought = self.thoughts.setdefault(t.index, _Thought())
            thought.text.append(t.text)
            thought.signature.append(t.signature)
            thought.redacted = t.redacted if t.redacted is not None else thought.redacted
        for d in p.tool_calls:
            call = self.calls.setdefault(d.index, _Call())
            call.id = d.id or call.id
            call.name = d.name or call.name
            call.arguments.append(d.arguments)

    def thinking_blocks(self) -> list[dict[str, Any]]:
        """The thinking blocks, whole, in order (Anthropic's shape)."""
        return [t.block() for _, t in sorted(self.thoughts.items())]

    def tool_calls(self) -> list[ToolCallOut] | None:
        if not self.calls:
            return None
        return [
            ToolCallOut(
                id=c.id, function=FunctionCallOut(name=c.name, arguments="".join(c.arguments))
            )
            for _, c in sorted(self.calls.items())
        ]


async def collect(pieces: Pieces, n: int = 1) -> tuple[list[Sample], Usage]:
    """The whole answer: each sample's text, finish reason and logprobs, and the usage."""
    samples = [Sample() for _ in range(n)]
    usage = Usage.of(0, 0, 0)
    async with aclosing(pieces):
        async for p in pieces:
            samples[p.index].add(p)
            usage = p.usage or usage
    return samples, usage


def _prompt_extras(shape: Shape, s: Sample | Piece) -> dict[str, Any]:
    """vLLM's prompt fields of an answer (chat) or a choice (text), where asked."""
    out: dict[str, Any] = {}
    if shape.token_ids and s.prompt_token_ids is not None:
        out["prompt_token_ids"] = list(s.prompt_token_ids)
    if shape.prompt_logprobs and s.prompt_logprobs is not None:
        out["prompt_logprobs"] = prompt_logprobs(s.prompt_logprobs)
    return out


def _content(shape: Shape, s: Sample) -> str | None:
    """A whole choice's content: what it echoes, then its text (None: only tool calls)."""
    text = shape.echo + "".join(s.text)
    return (text or None) if s.calls else text


async def chat_completion(rid: str, model: str, pieces: Pieces, shape: Shape) -> ChatCompletion:
    samples, usage = await collect(pieces, shape.n)
    choices = [
        ChatChoice(
            index=i,
            message=AssistantMessage(
                content=_content(shape, s),
                tool_calls=s.tool_calls(),
            ),
            finish_reason=s.finish_reason,
            logprobs=chat_logprobs(s.logprobs, shape.as_token_ids) if shape.logprobs else None,
            **({"token_ids": list(s.token_ids)} if shape.token_ids else {}),
        )
        for i, s in enumerate(samples)
    ]
    extras = _prompt_extras(shape, samples[0]) if samples else {}
    return ChatCompletion(id=rid, model=model, choices=choices, usage=usage, **extras)


async def chat_chunks(
    rid: str, model: str, pieces: Pieces, shape: Shape
) -> AsyncGenerator[ChatCompletionChunk, None]:
    """OpenAI's chat stream: each choice's role, the text as it comes, the finish reasons
    in last empty deltas, then (``include_usage``) a chunk with only the usage."""
    created = int(time.time())

    running = _Running(shape.continuous_usage)

    def chunk(
        index: int,
        delta: ChunkDelta,
        finish: str | None = None,
        lps: Any = None,
        ids: tuple[int, ...] | None = None,
        **extras: Any,
    ) -> ChatCompletionChunk:
        more = {"token_ids": list(ids)} if ids is not None and shape.token_ids else {}
        choice = ChunkChoice(index=index, delta=delta, finish_reason=finish, logprobs=lps, **more)
        return ChatCompletionChunk(
            id=rid,
            created=created,
            model=model,
            choices=[choice],
            usage=running.now(index),
            **extras,
        )

    finish: dict[int, str] = {}
    async with aclosing(pieces):  # closing the chunks closes the answer (and its request)
        first = await anext(pieces, None)  # primed: what the engine knew at the start
        head: dict[str, Any] = {}
        if first is not None:
            running.start(first)
            head = _prompt_extras(shape, first)
        for i in range(shape.n):
            role = ChunkDelta(role="assistant", content=shape.echo)
            yield chunk(i, role, **(head if i == 0 else {}))
        ended: set[int] = set()  # samples whose finish reason went out with their last text
        async for p in _then(first, pieces):
            running.see(p)
            if p.finish_reason:
                finish[p.index] = p.finish_reason
            if p.text or (shape.token_ids and p.token_ids) or (shape.logprobs and p.logprobs):
                lps = chat_logprobs(p.logprobs, shape.as_token_ids) if shape.logprobs else None
                last = p.finish_reason if not p.tool_calls else None  # vLLM's: with the text
                if last:
                    ended.add(p.index)
                delta = ChunkDelta(content=p.text)
                yield chunk(p.index, delta, last, lps=lps, ids=p.token_ids)
            if p.tool_calls:
                yield chunk(p.index, ChunkDelta(tool_calls=[_call_delta(d) for d in p.tool_calls]))
            if p.usage is not None:
                for i in range(shape.n):
                    if i not in ended:
                        yield chunk(i, ChunkDelta(), finish.get(i, "stop"))
                if shape.include_usage:
                    yield ChatCompletionChunk(
                        id=rid, created=created, model=model, choices=[], usage=p.usage
                    )


async def _then(first: Piece | None, rest: Pieces) -> Pieces:
    """``first`` (already read, where there was one), then ``rest``."""
    if first is not None:
        yield first
    async for p in rest:
        yield p


def _call_delta(d: ToolCallDelta) -> ToolCallDeltaOut:
    first = d.id is not None
    return ToolCallDeltaOut(
        index=d.index,
        id=d.id,
        type="function" if first else None,
        function=FunctionDeltaOut(name=d.name, arguments=d.arguments),
    )


def _ids(shape: Shape, s: Sample | Piece) -> dict[str, Any]:
    """vLLM's fields of a completion choice, where asked: ``return_token_ids``' prompt and
    output ids, the prompt's logprobs."""
    extras = _prompt_extras(shape, s)
    if shape.token_ids:
        extras["token_ids"] = list(s.token_ids)
    return extras


async def completion(rid: str, model: str, pieces: Pieces, shape: Shape) -> Completion:
    samples, usage = await collect(pieces, shape.n)
    choices = [
        CompletionChoice(
            index=i,
            text="".join(s.text),
            finish_reason=s.finish_reason,
            logprobs=(
                completion_logprobs(s.logprobs, 0, shape.as_token_ids) if shape.logprobs else None
            ),
            **_ids(shape, s),
        )
        for i, s in enumerate(samples)
    ]
    return Completion(id=rid, model=model, choices=choices, usage=usage)


async def completion_chunks(
    rid: str, model: str, pieces: Pieces, shape: Shape
) -> AsyncGenerator[Completion, None]:
    """OpenAI's text-completion stream: one chunk per piece of text (a sample's last with
    its finish reason), then (``include_usage``) a chunk with only the usage."""
    offsets = [0] * shape.n
    running = _Running(shape.continuous_usage)
    async with aclosing(pieces):
        async for p in pieces:
            if p.usage is None:
                running.see(p)
                lps = None
                if shape.logprobs:
                    lps = completion_logprobs(p.logprobs, offsets[p.index], shape.as_token_ids)
                offsets[p.index] += len(p.text)
                choice = CompletionChoice(
                    index=p.index,
                    text=p.text,
                    finish_reason=p.finish_reason,
                    logprobs=lps,
                    **_ids(shape, p),
                )
                yield Completion(id=rid, model=model, choices=[choice], usage=running.now(p.index))
            elif shape.include_usage:
                yield Completion(id=rid, model=model, choices=[], usage=p.usage)


@dataclass(frozen=True)
class Answer:
    """An answer under way: its id, and its pieces (the first already produced)."""

    id: str
    pieces: Pieces
