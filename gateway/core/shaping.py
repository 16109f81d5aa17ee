"""One answer shape, shaped once per API at the edge.

Every path (the local engine, a hosted provider) produces an answer as a
stream of :class:`Piece`: text as it is generated, the finish reason on the
piece that ends the text, and a last piece that carries only the usage.
The functions here turn that stream into OpenAI's chat completion (whole or
as chunks) and text completion (whole or as chunks); the gRPC edge and the
Responses API read the same pieces.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, TypeVar

from gateway.core.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChunkChoice,
    ChunkDelta,
    Completion,
    CompletionChoice,
    Usage,
)

T = TypeVar("T")
Pieces = AsyncGenerator["Piece", None]


@dataclass(frozen=True)
class Piece:
    """A piece of an answer: generated text, the finish reason once it ends, or (last)
    the usage of the whole answer."""

    text: str = ""
    finish_reason: str | None = None
    usage: Usage | None = None


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
class Collected:
    text: str
    finish_reason: str
    usage: Usage


async def collect(pieces: Pieces) -> Collected:
    """The whole answer: its text, finish reason and usage."""
    text: list[str] = []
    finish, usage = "stop", Usage.of(0, 0, 0)
    async with aclosing(pieces):
        async for p in pieces:
            text.append(p.text)
            finish = p.finish_reason or finish
            usage = p.usage or usage
    return Collected("".join(text), finish, usage)


async def chat_completion(rid: str, model: str, pieces: Pieces) -> ChatCompletion:
    a = await collect(pieces)
    choice = ChatChoice(message=AssistantMessage(content=a.text), finish_reason=a.finish_reason)
    return ChatCompletion(id=rid, model=model, choices=[choice], usage=a.usage)


async def chat_chunks(
    rid: str, model: str, pieces: Pieces, include_usage: bool
) -> AsyncGenerator[ChatCompletionChunk, None]:
    """OpenAI's chat stream: the role, the text as it comes, the finish reason in a last
    empty delta, then (``include_usage``) a chunk with only the usage."""
    created = int(time.time())

    def chunk(delta: ChunkDelta, finish: str | None = None) -> ChatCompletionChunk:
        choice = ChunkChoice(delta=delta, finish_reason=finish)
        return ChatCompletionChunk(id=rid, created=created, model=model, choices=[choice])

    finish = "stop"
    async with aclosing(pieces):  # closing the chunks closes the answer (and its request)
        yield chunk(ChunkDelta(role="assistant", content=""))
        async for p in pieces:
            if p.text:
                yield chunk(ChunkDelta(content=p.text))
            finish = p.finish_reason or finish
            if p.usage is not None:
                yield chunk(ChunkDelta(), finish)
                if include_usage:
                    yield ChatCompletionChunk(
                        id=rid, created=created, model=model, choices=[], usage=p.usage
                    )


async def completion(rid: str, model: str, pieces: Pieces) -> Completion:
    a = await collect(pieces)
    choice = CompletionChoice(text=a.text, finish_reason=a.finish_reason)
    return Completion(id=rid, model=model, choices=[choice], usage=a.usage)


async def completion_chunks(
    rid: str, model: str, pieces: Pieces, include_usage: bool
) -> AsyncGenerator[Completion, None]:
    """OpenAI's text-completion stream: one chunk per piece of text (the last with the
    finish reason), then (``include_usage``) a chunk with only the usage."""
    async with aclosing(pieces):
        async for p in pieces:
            if p.usage is None:
                choice = CompletionChoice(text=p.text, finish_reason=p.finish_reason)
                yield Completion(id=rid, model=model, choices=[choice])
            elif include_usage:
                yield Completion(id=rid, model=model, choices=[], usage=p.usage)


@dataclass(frozen=True)
class Answer:
    """An answer under way: its id, and its pieces (the first already produced)."""

    id: str
    pieces: Pieces
