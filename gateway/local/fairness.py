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

Priorities come first twice over.  A waiting request of a higher class goes
before any of a lower one; and while a request waits for its first token on a
replica, no request of a lower class starts there (the first-token guard): a
batch request started beside an interactive prompt would share its prefill
steps.  So an interactive turn waits for what was already running, at most
one engine step of a lower class's prefill, and nothing that came after it.
With ``slots`` None the gate only orders by class this way.

What the guard cannot hold back is what had started before: prompts of lower
classes already in prefill share the interactive prompt's steps (vLLM does
not preempt a running prefill for a waiting one).  With ``preempt`` the gate
stops them: when a request of a higher class arrives, each lower-class
request still in prefill on the replica is told to stop (:attr:`Entry.stop`);
its caller aborts it in the engine, :meth:`FairGate.withdraw` takes back its
slot and its charge, and it enters again, behind the higher class.  The
blocks its prefill had computed stay in vLLM's prefix cache, so starting
again costs at most a partial block; a request is stopped a bounded number
of times (the caller's count), so a stream of higher-class arrivals cannot
starve it.  ``prefill_slots`` caps how many requests of a class prefill at
once on a replica (``{0: 1, 1: 1}``: one default and one batch prompt at a
time), so an interactive turn meets at most that many chunks of theirs in a
step.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypeVar

K = TypeVar("K", bound=str)  # a replica's id


@dataclass(eq=False)
class Entry:
    """One request let through the gate; prefilling until its first token."""

    tenant: str
    priority: int
    cost: int = 0  # what it was charged on entry
    prefilling: bool = True
    stop: asyncio.Event = field(default_factory=asyncio.Event)  # set: a higher class came


@dataclass(eq=False)
class _Waiter:
    tenant: str
    priority: int  # vLLM's: lower first
    cost: int
    seq: int  # arrival order: ties go to the earliest
    ready: asyncio.Future[Entry] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class Scope:
    """The gates of replicas that share their compute (see the module): the first-token
    guard and its stops act across all of them."""

    def __init__(self) -> None:
        self.gates: list[FairGate] = []

    def prefilling_above(self, priority: int) -> bool:
        """A request of a class above ``priority`` waits for its first token on one of
        the gates."""
        return any(g.prefilling_above(priority) for g in self.gates)

    def stop_lower(self, priority: int) -> None:
        for g in self.gates:
            g.stop_lower(priority)

    def grant(self) -> None:
        """Slots to waiters on every gate: a first token here may free them all."""
        for g in self.gates:
            g.grant()


class FairGate:
    def __init__(
        self,
        slots: int | None,
        guard: bool = True,
        prefill_slots: dict[int, int] | None = None,
        preempt: bool = False,
        scope: Scope | None = None,
    ) -> None:
        self.slots = math.inf if slots is None else slots
        self.guard = guard  # the first-token guard (see the module's docstring)
        # lower classes' prefills stop for a higher class (with the guard, which then
        # holds them until its first token: without it they would start again at once)
        self.preempt = preempt and guard
        self._entries: set[Entry] = set()  # let through, not yet left
        self.prefill_slots = dict(prefill_slots or {})  # by priority; absent: no cap
        self.running = 0
        self.counters: dict[str, float] = {}
        self._waiting: dict[tuple[int, str], deque[_Waiter]] = {}
        self._prefilling: Counter[int] = Counter()  # by priority: admitted, no token yet
        self.waited = 0  # requests that had to wait for a slot
        self.held = 0  # of which, held by the guard or a prefill slot
        self.scope = scope or Scope()  # the gates the guard acts across (this one at least)
        self.scope.gates.append(self)

    def __len__(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    def _held(self, priority: int) -> bool:
        """A request of a higher class is waiting for its first token here or on a gate of
        this one's scope (the guard), or its own class has every prefill slot here."""
        if self.guard and self.scope.prefilling_above(priority):
            return True
        cap = self.prefill_slots.get(priority)
        return cap is not None and self._prefilling[priority] >= cap

    def free(self, priority: int = 0) -> bool:
        """Whether a request of ``priority`` entering now starts without waiting."""
        return self.running < self.slots and not len(self) and not self._held(priority)

    def _charge(self, tenant: str, tokens: float) -> None:
        self.counters[tenant] = self.counters.get(tenant, 0.0) + tokens

    def _lift(self, tenant: str) -> None:
        """A tenant that starts waiting: no less than the least counter of those waiting."""
        waiting = {t for (_, t), q in self._waiting.items() if q}
        if tenant in waiting or not waiting:
            return
        floor = min(self.counters.get(t, 0.0) for t in waiting)
        self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)

    def _admit(self, tenant: str, priority: int, cost: int) -> Entry:
        self.running += 1
        self._charge(tenant, cost)
        self._prefilling[priority] += 1
        entry = Entry(tenant, priority, cost)
        self._entries.add(entry)
        return entry

    def prefilling_above(self, priority: int) -> bool:
        """A request of a class above ``priority`` waits for its first token here."""
        return any(p < priority for p, n in self._prefilling.items() if n)

    def stop_lower(self, priority: int) -> None:
        """Tell the requests of lower classes still in prefill here to stop."""
        for e in self._entries:
            if e.prefilling and e.priority > priority:
                e.stop.set()

    async def enter(self, tenant: str, priority: int, cost: int) -> Entry:
        """Let one request of ``tenant`` through (``cost``: the prompt tokens it
        computes); cancelled while waiting, it leaves the queue."""
        if self.preempt:
            self.scope.stop_lower(priority)
        if self.free(priority):
            return self._admit(tenant, priority, cost)
        self._lift(tenant)
        w = _Waiter(tenant, priority, cost, self.waited)
        self._waiting.setdefault((priority, tenant), deque()).append(w)
        self.waited += 1
        self.grant()  # a slot may be free to a waiter the guard does not hold (this one)
        if not w.ready.done() and self.running < self.slots:
            self.held += 1  # a slot is free: the guard or a prefill slot holds this one
        try:
            return await w.ready
        except asyncio.CancelledError:
            if w.ready.done() and not w.ready.cancelled():  # granted as it was cancelled
                self.leave(w.ready.result(), 0)
            else:
                self._waiting[(priority, tenant)].remove(w)
            raise

    def first_token(self, entry: Entry) -> None:
        """The request's prompt is prefilled: lower classes may start beside it."""
        if entry.prefilling:
            entry.prefilling = False
            self._prefilling[entry.priority] -= 1
            self.scope.grant()

    def leave(self, entry: Entry, output_tokens: int) -> None:
        """The request ended: its output tokens are charged, its slot goes to the next."""
        if entry.prefilling:
            entry.prefilling = False
            self._prefilling[entry.priority] -= 1
        self._charge(entry.tenant, output_tokens)
        self._entries.discard(entry)
        self.running -= 1
        self.scope.grant()

    def withdraw(self, entry: Entry) -> None:
        """A request stopped in its prefill (for a higher class) gives back its slot and
        its charge; it enters again."""
        self._charge(entry.tenant, -entry.cost)
        self.leave(entry, 0)

    def grant(self) -> None:
        """Free slots here to the waiters the guard does not hold, in fair order."""
        while self.running < self.slots:
            nxt = self._next()
            if nxt is None:
                return  # nobody waits, or every class that does is held
            w = nxt.popleft()
            w.ready.set_result(self._admit(w.tenant, w.priority, w.cost))

    def _next(self) -> deque[_Waiter] | None:
        """The queue of the highest priority's least-served tenant, among the classes
        not held."""
        best: tuple[int, float, int] | None = None
        pick: deque[_Waiter] | None = None
        held: dict[int, bool] = {}
        for (prio, tenant), q in self._waiting.items():
            if q and not held.setdefault(prio, self._held(prio)):
                key = (prio, self.counters.get(tenant, 0.0), q[0].seq)
                if best is None or key < best:
                    best, pick = key, q
        return pick


def gates(
    shares: Mapping[K, str | None],
    slots: int | None,
    guard: bool,
    prefill_slots: dict[int, int] | None,
    preempt: bool,
) -> dict[K, FairGate]:
    """A gate for each replica of ``shares`` (its id: the compute it shares, or None);
    replicas that name the same compute share a :class:`Scope`."""
    scopes: dict[str, Scope] = {}
    return {
        rid: FairGate(
            slots, guard, prefill_slots, preempt, scopes.setdefault(s, Scope()) if s else None
        )
        for rid, s in shares.items()
    }
