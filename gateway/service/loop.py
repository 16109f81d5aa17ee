"""The one loop every chat request goes through, whatever its target.

For each target of the request's model, cheapest first (each quotes what the
prompt would cost there; :func:`by_cost`), else in alias order: admit,
prepare (decide and render; nothing claimed, nothing sent), journal what
will be sent, acquire (what waits before the send, and what the target
claims for it), send, and journal the answer before its usage goes out;
then settle.  A target that fails before the first token (unavailable,
overloaded, a context too small, a provider that still fails after its
retries) gives way to the next, and ``served.fallback_from`` says so.  What
a target acquired is released in one ``finally`` (:meth:`ServiceLoop.serve`)
on every path: the answer, an error, a fallback, a journal that failed (503
``session_log_unavailable``), a client that left; so a client's retry never
waits on a claim whose request is gone.  This is the only place that
journals, falls back and writes where a request was served.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from contextlib import aclosing
from typing import Any

from gateway.core.config import RoutingSettings
from gateway.core.errors import APIError
from gateway.core.metrics import Metrics
from gateway.core.outputs import Usage
from gateway.core.schemas import tool_calls_json
from gateway.core.shaping import Pieces, Sample, primed
from gateway.core.target import Call, Prepared, Quote, Target
from gateway.core.types import Served
from gateway.service.journal import Journal
from gateway.service.targets import by_cost, can_fall_back
from manifest.canonical import canonical_json

log = logging.getLogger(__name__)

Resolve = Callable[[str], Target[Any]]


class ServiceLoop:
    def __init__(
        self,
        journal: Journal,
        metrics: Metrics,
        resolve: Resolve,
        routing: RoutingSettings | None = None,
    ) -> None:
        self.journal = journal
        self._metrics = metrics
        self._resolve = resolve  # a target name → the Target that serves it
        self.routing = routing or RoutingSettings()

    async def order(
        self, names: Sequence[str], call: Call, served: Served
    ) -> list[tuple[str, Quote | None]]:
        """``names`` in the order they are tried, each with its quote: cheapest first when
        every target can quote (else, and under ``routing.by: order``, the alias order).
        A first target that quotes nothing to pay (the local replicas at price 0) cannot
        be beaten: the rest are not quoted and follow in alias order."""
        alias: list[tuple[str, Quote | None]] = [(n, None) for n in names]
        if len(names) < 2 or self.routing.by == "order":
            return alias
        quotes: list[Quote] = []
        with call.trace.step("quote"):
            for n in names:
                q = await self._resolve(n).quote(n, call)
                if q is None:
                    return alias
                quotes.append(q)
                if len(quotes) == 1 and q.rate == 0:
                    break
        if len(quotes) < len(names):  # the first is free
            order, quoted = list(names), {names[0]: quotes[0]}
        else:
            order = by_cost(names, quotes, self.routing.margin)
            quoted = dict(zip(names, quotes, strict=True))
        served.routed_by = "order" if order[0] == names[0] else "cost"
        self._metrics.alias_routes.labels(order[0], served.routed_by).inc()
        return [(n, quoted.get(n)) for n in order]

    async def first_answer(
        self, names: Sequence[str], call: Call, served: Served, whole: bool = False
    ) -> tuple[str, Pieces]:
        """The request id and answer of the first target in ``names`` that serves
        ``call``, its first piece produced (each fallback is a request of its own, with an
        id of its own).  ``whole``: the answer is read to its end here, so a target that
        fails at any point before it ends falls back too."""
        order = await self.order(names, call, served)
        for i, (name, quote) in enumerate(order):
            attempt = (
                call if i == 0 else dataclasses.replace(call, request_id=f"{call.request_id}-{i}")
            )
            try:
                pieces = await primed(self.serve(name, attempt, served, quote))
                return attempt.request_id, (await _drained(pieces) if whole else pieces)
            except APIError as exc:
                if i == len(order) - 1 or not can_fall_back(exc):
                    raise
                reason = exc.code or exc.type
                log.warning("%s failed (%s: %s); trying %s", name, reason, exc, order[i + 1][0])
                self._metrics.fallbacks.labels(name, reason).inc()
                served.fallback_from += (name,)
        raise AssertionError("no targets")  # Targets.resolve never returns an empty list

    async def serve(
        self, name: str, call: Call, served: Served | None, quote: Quote | None = None
    ) -> Pieces:
        """One target's answer: admitted, prepared, journaled, acquired, sent, settled;
        every claim given back on the way out (see the module)."""
        target = self._resolve(name)
        with target.admission(call):
            p = await target.prepare(name, call, quote)
            if served is not None:
                served.target, served.notes = p.target, dict(p.notes)
            op = self.journal.open(call.who.tenant, p.header, p.turns, call.session)
            held = [p]  # each Prepared this call had: what they claimed goes back below
            try:
                await self._journal(op, served, call, p)
                if op is not None and op.kind is not None:
                    self._metrics.sessions.labels(op.kind).inc()
                p = await target.acquire(p)
                held.append(p)
                if served is not None:
                    served.dispatch = p.placement
                answer, attempt = Sample(), 0
                while True:
                    yielded = False
                    try:
                        async with aclosing(target.send(p, op.session_id if op else None)) as out:
                            async for piece in out:
                                if piece.usage is not None:  # the end: all is known
                                    await self._answered(op, served, call, answer, piece.usage)
                                    target.settle(p, piece.usage)  # before the client leaves
                                elif piece.index == 0:
                                    answer.add(piece)
                                yielded = True
                                yield piece
                        break
                    except Exception as exc:
                        again = None if yielded or attempt else target.retry(p, exc)
                        if again is None:
                            raise
                        p, attempt = again, attempt + 1
                        held.append(p)
                        await self._journal(op, served, call, p)
            finally:
                for q in held:
                    target.release(q)

    async def _journal(self, op: Any, served: Served | None, call: Call, p: Prepared) -> None:
        """Record what ``p`` will send, before anything waits or is claimed for it."""
        with call.trace.step("journal"):
            s = p.sent
            await self.journal.sent(
                op, served, s.request_id, s.target, s.render, s.directives, s.body
            )

    async def _answered(
        self,
        op: Any,
        served: Served | None,
        call: Call,
        answer: Sample,
        usage: Usage,
    ) -> None:
        """Journal the answer (sample 0, the one the conversation goes on with) before its
        usage goes out: its text and the tools it called."""
        calls = answer.tool_calls()
        called = tool_calls_json([c.model_dump() for c in calls]) if calls else None
        blocks = answer.thinking_blocks()
        thinking = canonical_json(blocks).decode() if blocks else None
        text = "".join(answer.text)
        await self.journal.answered(op, served, call.request_id, text, usage, called, thinking)


async def _drained(pieces: Pieces) -> Pieces:
    """``pieces`` read to the end first (errors raised here), then replayed."""
    got = []
    async with aclosing(pieces):
        async for p in pieces:
            got.append(p)

    async def replay() -> Pieces:
        for p in got:
            yield p

    return replay()
