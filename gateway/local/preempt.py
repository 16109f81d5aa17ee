"""A lower class's prompt stopped in its prefill for a higher class, and started again.

vLLM schedules its running requests before its waiting ones, so a batch
prompt already in prefill shares every step of an interactive prompt that
arrives after it (priority scheduling preempts only when KV blocks run out).
The fair gate tells such a request to stop (:attr:`Entry.stop`, set when a
higher class enters); :func:`started` then aborts it in the engine before its
first token, gives its slot back (:meth:`FairGate.withdraw`) and enters the
gate again, where it waits behind the higher class.  The blocks it had
computed stay in vLLM's prefix cache: the next attempt starts from them.
After :data:`MAX_STOPS` stops a request runs to the end.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

from engines.base import GenerateChunk
from gateway.local.fairness import Entry, FairGate

MAX_STOPS = 3  # a request is stopped at most this many times, then runs on


@dataclass
class Held:
    """A request's current place in its replica's gate (None between two)."""

    entry: Entry | None
    stops: int = 0


async def first_or_stop(
    stream: AsyncIterator[GenerateChunk], stop: asyncio.Event
) -> GenerateChunk | Literal["stopped"] | None:
    """The stream's first chunk (None: it ended without one), or ``"stopped"`` when
    ``stop`` is set first: the pending read is cancelled, which aborts the request in
    the engine.  A chunk that arrives as the stop does wins."""

    async def first() -> GenerateChunk | None:
        return await anext(stream, None)

    nxt = asyncio.ensure_future(first())
    halt = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({nxt, halt}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the client went away: the read ends before the stream
        halt.cancel()
        nxt.cancel()
        await asyncio.wait({nxt})  # (closing a stream still being read would fail)
        raise
    halt.cancel()
    if not nxt.done():
        nxt.cancel()
        await asyncio.wait({nxt})
    if nxt.cancelled():
        return "stopped"
    return nxt.result()


async def started(
    open_stream: Callable[[], AsyncGenerator[GenerateChunk, None]],
    gate: FairGate | None,
    held: Held,
    enter: Callable[[FairGate], Awaitable[Entry]],
    stopped: Callable[[], None],
) -> tuple[AsyncGenerator[GenerateChunk, None], GenerateChunk | None]:
    """One request's engine stream, open, and its first chunk (None: it ended without
    one); the caller reads the rest from the stream itself (nothing of this module on
    the per-token path) and closes it.  Until that first chunk, a stop from ``gate``
    aborts the request, and it enters the gate again (``enter``) and starts over
    (``stopped`` counts)."""
    while True:
        e = held.entry
        stop = None if gate is None or not gate.preempt or e is None else e.stop
        if held.stops >= MAX_STOPS:
            stop = None  # it runs on
        if stop is None or not stop.is_set():
            stream = open_stream()
            try:
                first = await (anext(stream, None) if stop is None else first_or_stop(stream, stop))
            except BaseException:
                await stream.aclose()
                raise
            if first != "stopped":
                return stream, first
            await stream.aclose()
        assert gate is not None and e is not None  # (a stop needs both)
        held.stops += 1
        stopped()
        held.entry = None
        gate.withdraw(e)
        held.entry = await enter(gate)
