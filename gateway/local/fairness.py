"""Fair shares of a replica across tenants: virtual token counting in front of the engine.

With ``engine.max_num_seqs`` set, each replica takes at most that many
requests at once; the rest wait here, and when a slot frees the next request
is the one of the highest priority class whose tenant has been served the
fewest tokens (the Virtual Token Counter of Sheng et al., "Fairness in
Serving Large Language Models", OSDI 2024).  A tenant's counter grows by the
prompt tokens the engine must compute (its uncached prefill) when it enters
and by its output tokens when it leaves; a tenant that comes back after a
quiet spell is lifted to the least counter among the waiting, so idle time
is not banked as credit.  A tenant sending ten times the load then gets its
share of the engine, not ten shares, and another tenant's interactive turn
waits behind at most the requests already running.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Waiter:
    tenant: str
    priority: int  # vLLM's: lower first
    cost: int
    seq: int  # arrival order: ties go to the earliest
    ready: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class FairGate:
    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.running = 0
        self.counters: dict[str, float] = {}
        self._waiting: dict[tuple[int, str], deque[_Waiter]] = {}
        self.waited = 0  # requests that had to wait for a slot

    def __len__(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    def free(self) -> bool:
        """Whether a request entering now gets a slot without waiting."""
        return self.running < self.slots and not len(self)

    def _charge(self, tenant: str, tokens: float) -> None:
        self.counters[tenant] = self.counters.get(tenant, 0.0) + tokens

    def _lift(self, tenant: str) -> None:
        """A tenant that starts waiting: no less than the least counter of those waiting."""
        waiting = {t for (_, t), q in self._waiting.items() if q}
        if tenant in waiting or not waiting:
            return
        floor = min(self.counters.get(t, 0.0) for t in waiting)
        self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)

    async def enter(self, tenant: str, priority: int, cost: int) -> None:
        """A slot for one request of ``tenant`` (``cost``: the prompt tokens it computes);
        cancelled while waiting, it leaves the queue."""
        if self.free():
            self.running += 1
            self._charge(tenant, cost)
            return
        self._lift(tenant)
        w = _Waiter(tenant, priority, cost, self.waited)
        self._waiting.setdefault((priority, tenant), deque()).append(w)
        self.waited += 1
        try:
            await w.ready
        except asyncio.CancelledError:
            if w.ready.done() and not w.ready.cancelled():  # granted as it was cancelled
                self.leave(tenant, 0)
            else:
                self._waiting[(priority, tenant)].remove(w)
            raise

    def leave(self, tenant: str, output_tokens: int) -> None:
        """The request ended: its output tokens are charged, its slot goes to the next."""
        self._charge(tenant, output_tokens)
        self.running -= 1
        self._grant()

    def _grant(self) -> None:
        while self.running < self.slots:
            nxt = self._next()
            if nxt is None:
                return
            self.running += 1
            self._charge(nxt.tenant, nxt.cost)
            nxt.ready.set_result(None)

    def _next(self) -> _Waiter | None:
        """The head of the highest priority's least-served tenant's queue."""
        best: tuple[int, float, int] | None = None
        pick: deque[_Waiter] | None = None
        for (prio, tenant), q in self._waiting.items():
            if q:
                key = (prio, self.counters.get(tenant, 0.0), q[0].seq)
                if best is None or key < best:
                    best, pick = key, q
        return pick.popleft() if pick is not None else None
