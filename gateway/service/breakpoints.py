"""A client's cache breakpoints on the local model: where they fall in the prompt's
tokens, what the answer's usage says was written through them, and the leases that
keep their KV blocks (:mod:`gateway.local.retention`).

A mark on ``tools`` or ``system`` ends where the system prompts and tools render
to; a mark on turn ``i`` where the prompt through that turn renders to (the
last turn: the whole prompt, only the template's few tokens that open the
answer follow it).  Positions are remembered per (system, tools, turns).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from gateway.core.outputs import Usage
from gateway.core.pieces import Piece
from gateway.core.schemas import Breakpoint
from gateway.local.dispatch import Dispatch
from gateway.local.retention import BreakpointLeases
from gateway.local.spans import KVSpans
from manifest.canonical import canonical_json
from manifest.sessionlog import MessageEvent

SystemPrompts = tuple[str, ...]
Turns = tuple[MessageEvent, ...]
Render = Callable[[SystemPrompts, Turns, list[dict[str, Any]] | None], list[int]]
Ends = list[tuple[int, int]]  # (token position, TTL in s) per breakpoint

REMEMBERED = 1024


class PrefixLengths:
    """How many leading tokens of a prompt a prefix of its conversation renders to
    (``render``: the render thread's, :mod:`gateway.service.render_thread`; one job
    asks at a time, on that thread or on the loop)."""

    def __init__(self) -> None:
        self._seen: OrderedDict[tuple[SystemPrompts, bytes, Turns], int] = OrderedDict()

    def __call__(
        self,
        render: Render,
        system: SystemPrompts,
        turns: Turns,
        tools: list[dict[str, Any]],
        ids: Sequence[int],
    ) -> int:
        key = (system, canonical_json(tools) if tools else b"", turns)
        n = self._seen.get(key)
        if n is not None:
            self._seen.move_to_end(key)
            return n
        head = render(system, turns, tools)
        n = 0
        while n < min(len(head), len(ids)) and head[n] == ids[n]:
            n += 1
        self._seen[key] = n
        if len(self._seen) > REMEMBERED:
            self._seen.popitem(last=False)
        return n

    def renders(
        self,
        anchor: bool,
        marks: Sequence[Breakpoint],
        system: SystemPrompts,
        turns: Turns,
        tools: list[dict[str, Any]],
    ) -> int:
        """How many renders finding the anchor (``anchor``) and ``marks``' ends would make:
        the prefixes not remembered (asked before a job, with no job running)."""
        listed = canonical_json(tools) if tools else b""
        heads: set[tuple[SystemPrompts, bytes, Turns]] = set()
        if anchor:
            heads.add((system, listed, ()))
        for bp in marks:
            if bp.segment in ("tools", "system"):
                heads.add((system, listed, ()))
            elif (i := int(bp.segment.partition(":")[2])) < len(turns) - 1:
                heads.add((system, listed, turns[: i + 1]))
        return sum(key not in self._seen for key in heads)

    def ends(
        self,
        render: Render,
        marks: Sequence[Breakpoint],
        system: SystemPrompts,
        turns: Turns,
        tools: list[dict[str, Any]],
        ids: Sequence[int],
    ) -> Ends:
        out = []
        for bp in marks:
            if bp.segment in ("tools", "system"):
                pos = self(render, system, (), tools, ids)
            else:
                i = int(bp.segment.partition(":")[2])
                last = i >= len(turns) - 1
                pos = len(ids) if last else self(render, system, turns[: i + 1], tools, ids)
            out.append((pos, bp.ttl_s))
        return out


class Retained:
    """One answer's breakpoints on its replica: at its end the blocks through each are
    leased for its TTL, and the usage says how many prompt tokens were newly cached
    through the last breakpoint (Anthropic's ``cache_creation_input_tokens``).  A
    :class:`~gateway.core.pieces.Step`."""

    def __init__(
        self,
        d: Dispatch,
        ends: Ends,
        owner: str,
        kv: KVSpans | None,
        block: int,
        leases: BreakpointLeases,
    ) -> None:
        self._d, self._ends, self._owner = d, ends, owner
        self._kv, self._block, self._leases = kv, block, leases

    def step(self, p: Piece) -> Sequence[Piece]:
        return (p,)

    async def end(self, last: Piece) -> Piece:
        u = last.usage
        if u is None:
            return last
        cached = u.prompt_tokens_details.cached_tokens
        through = max(pos for pos, _ in self._ends) // self._block * self._block
        written = max(0, min(through, u.prompt_tokens) - cached)
        usage = Usage.of(u.prompt_tokens, u.completion_tokens, cached, written)
        if self._kv is not None and self._d.hashes:
            d, kv = self._d, self._kv
            await _lease(kv, d, self._ends, self._owner, self._block, self._leases)
        return dataclasses.replace(last, usage=usage)


async def _lease(
    kv: KVSpans, d: Dispatch, ends: Ends, owner: str, block: int, leases: BreakpointLeases
) -> None:
    tiers: dict[int, int] = {}  # TTL → the furthest position marked with it
    for pos, ttl in ends:
        tiers[ttl] = max(tiers.get(ttl, 0), pos)
    for ttl, pos in sorted(tiers.items()):
        n = min(pos // block, len(d.hashes))
        await leases.hold(kv, d.replica.id, f"{owner}:{ttl}s", d.hashes[:n], ttl)
