"""The one answer protocol: every path (the local engine, a hosted provider) produces an
answer as a stream of :class:`Piece`: text as it is generated (with its token logprobs
when asked for, and the index of its sample when ``n > 1``), the finish reason on the
piece that ends a sample, and a last piece that carries only the usage.
:func:`primed` produces an answer's first piece before a response starts, so an error
before it is still an error status, not a broken stream.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from engines.base import TokenLogprob
from engines.providers.base import ThinkingPart
from gateway.core.outputs import Usage

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


class Step(Protocol):
    """A per-piece step of an answer (its tool calls read out of the text, its JSON
    escaped, its breakpoints' lease at the end): plain calls the answer's one generator
    makes, not a generator of its own around the answer (one a layer, per token)."""

    def step(self, p: Piece) -> Sequence[Piece]:
        """What ``p`` (a piece of text, not the usage) comes out as: nothing, itself,
        or several pieces."""
        ...

    async def end(self, last: Piece) -> Piece:
        """The last piece (the usage) as it goes out; it may await (a lease taken before
        the client hears that the answer ended)."""
        ...


def stepped(p: Piece, steps: Sequence[Step]) -> Sequence[Piece]:
    """What ``p`` comes out as through ``steps``, in order."""
    out: Sequence[Piece] = (p,)
    for s in steps:
        out = s.step(out[0]) if len(out) == 1 else [q for x in out for q in s.step(x)]
    return out


async def ended(last: Piece, steps: Sequence[Step]) -> Piece:
    """The usage piece through each step's :meth:`Step.end`, in order."""
    for s in steps:
        last = await s.end(last)
    return last


@dataclass(frozen=True)
class Answer:
    """An answer under way: its id, and its pieces (the first already produced)."""

    id: str
    pieces: Pieces


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
