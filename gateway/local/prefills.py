"""Prompts being prefilled on each replica, until their first token.

A request routed while another with the same prefix is still being prefilled
would be planned against an index that does not hold those blocks yet: it is
sent where it is not cached, or beside the other and computes the same
blocks again, and either way its predicted cached tokens are wrong.  The
dispatcher counts the blocks of running prefills as the replica's (so
siblings meet on one replica, as llm-d's precise scorer pre-indexes routed
blocks) and then waits, bounded, for the prefill it overlaps to produce its
first token: the engine has stored those blocks, the next index sync has
seen them, and the request is predicted exactly and served from them
instead of computing them a second time.

A registration is a claim with a receipt: :meth:`Prefills.start` returns the
:class:`Prefill`, and its owner gives it back with :meth:`Prefills.finish` at
the first token, at the request's end, or, when the request never reached the
engine (its journal failed, its client left, it fell back elsewhere), as soon
as that is known (the service loop's ``finally``), so no sibling waits for a
prefill that will never run.  The hold on the blocks the prompt was predicted to
read (:mod:`gateway.local.kv_holds`) rides on the same receipt, for the same
span of time: :meth:`Prefills.finish` gives it back too.

What a running prefill will store is known when a sibling is routed: its
blocks' hashes.  :meth:`Prefills.overlap` answers with them (the pending span
and the prefill that will store it); routing counts them as the replica's, the
sibling joins the prefill on them, and its prediction says whether it waited
for them to be stored (exact) or went with the prefill still running
(approximate: what it reads depends on which of them vLLM schedules first).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gateway.local.kv_holds import Hold
from manifest.hashing import BlockHash
from manifest.index import LocationId


@dataclass(eq=False)
class Prefill:
    replica: LocationId
    hashes: tuple[BlockHash, ...]
    started: float = 0.0
    done: asyncio.Event = field(default_factory=asyncio.Event)
    hold: Hold | None = None  # the blocks it was predicted to read, held until its first token


def _common(a: Sequence[BlockHash], b: Sequence[BlockHash]) -> int:
    """Leading blocks two prompts share (a block hash names its whole prefix)."""
    n = min(len(a), len(b))
    lo, hi = 0, n  # the shared blocks are a prefix: the last shared one decides
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class Prefills:
    """Registered when a request is routed, finished at its first token (or its end, or
    when its send will never run).  One older than ``max_age_s`` is forgotten: its
    request waits in the engine's queue longer than anyone should wait for it (or an
    owner lost its receipt: the age is a backstop, not the release)."""

    def __init__(self, max_age_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self._running: dict[LocationId, list[Prefill]] = {}
        self._max_age_s = max_age_s
        self._clock = clock

    def start(
        self, replica: LocationId, hashes: Sequence[BlockHash], hold: Hold | None = None
    ) -> Prefill | None:
        """Register a prompt's full blocks as being prefilled on ``replica``, with the
        ``hold`` on the blocks it reads (None when it has no full block: nothing to
        register, and nothing can be held)."""
        if not hashes:
            if hold is not None:
                hold.give()
            return None
        p = Prefill(replica, tuple(hashes), self._clock(), hold=hold)
        self._running.setdefault(replica, []).append(p)
        return p

    def finish(self, p: Prefill | None) -> None:
        """``p``'s first token came (or it ended): its blocks are stored, or never will be;
        the engine has scheduled it (or never will), so its hold is given back."""
        if p is None or p.done.is_set():
            return
        p.done.set()
        if p.hold is not None:
            p.hold.give()
        running = self._running.get(p.replica, [])
        if p in running:
            running.remove(p)

    def overlap(self, hashes: Sequence[BlockHash]) -> dict[LocationId, tuple[int, Prefill]]:
        """Per replica, the running prefill sharing the most leading blocks with ``hashes``
        and how many it shares (replicas with none are left out)."""
        out: dict[LocationId, tuple[int, Prefill]] = {}
        old = self._clock() - self._max_age_s
        for replica, running in self._running.items():
            running[:] = [p for p in running if p.started >= old]
            best: tuple[int, Prefill] | None = None
            for p in running:
                n = _common(hashes, p.hashes)
                if n and (best is None or n > best[0]):
                    best = (n, p)
            if best is not None:
                out[replica] = best
        return out

    def __len__(self) -> int:
        return sum(len(v) for v in self._running.values())
