"""Waiting on a fact instead of sleeping: the hermetic tier orders events by what
happened, never by how long it took (docs/development.md)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def until(cond: Callable[[], object], what: str = "", timeout_s: float = 10.0) -> None:
    """Yield to the event loop until ``cond()`` holds: the other tasks' steps make it
    true, however fast the machine.  The deadline only turns a hang into a failure."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        assert loop.time() < deadline, f"never came: {what or cond}"
        await asyncio.sleep(0)


async def turns(n: int = 100) -> None:
    """Let the other ready tasks run ``n`` turns of the event loop: whatever they can do
    without a clock or I/O, they have done (a window counted in steps, not seconds, the
    same on every machine)."""
    for _ in range(n):
        await asyncio.sleep(0)
