"""The one loop every request that reaches a model goes through, whatever its target:
chats (OpenAI's, the Responses and Messages APIs, batches, a provider's warm), text
completions and the local cache warm.

First, intake (:mod:`gateway.service.attachment_intake`): the images and
documents a chat carries are decoded or fetched, bounded, checked and stored,
before anything is quoted or prepared (nothing to do for a text-only call).
For each target of the request's model, cheapest first (each quotes what the
prompt would cost there; :func:`by_cost`), else in alias order: admit,
prepare (decide and render; nothing claimed, nothing sent), journal what
will be sent, acquire (what waits before the send, and what the target
claims for it), send, and journal the answer before its usage goes out;
then settle.  A request served as several engine requests (a text
completion's prompts, :meth:`ServiceLoop.first_answer_each`) is admitted
once, has every one prepared before any is journaled, and each goes on
through journal, acquire, send, settle and release on its own; their
answers are joined into the request's.  A target that fails before the
first token (unavailable, overloaded, a context too small, a provider that
still fails after its retries) gives way to the next, and
``served.fallback_from`` says so.  A call with images or documents goes only
to the targets that see (:func:`~gateway.service.targets.seeing`): the rest
are not quoted nor tried.  What a target acquired is released in
one ``finally`` (:meth:`ServiceLoop._sent`) on every path: the answer, an
error, a fallback, a journal that failed (503 ``session_log_unavailable``),
a client that left; so a client's retry never waits on a claim whose
request is gone.  This is the only place that journals and falls back, and
the one writer of where a request was served: each answer comes back as a
:class:`~gateway.core.types.Routed` value whose :class:`~gateway.core.types.Served`
the loop made and fills in (the target and its notes at prepare, the session at
the journal, the replica at acquire, the answer's sequence in the session once
it ends); callers read it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from contextlib import aclosing
from typing import Any

from gateway.core.config import RoutingSettings
from gateway.core.errors import APIError
from gateway.core.metrics import Metrics
from gateway.core.outputs import Usage
from gateway.core.pieces import Answer, Pieces, primed
from gateway.core.samples import Sample
from gateway.core.schemas import ChatCompletionRequest
from gateway.core.target import Call, Prepared, Quote, Target
from gateway.core.types import Routed, Served
from gateway.service.attachment_intake import AttachmentIntake
from gateway.service.journal import Journal
from gateway.service.targets import by_cost, can_fall_back, seeing, sees

log = logging.getLogger(__name__)

Resolve = Callable[[str], Target[Any]]
Join = Callable[[Sequence[Pieces]], Pieces]  # engine requests' answers → the request's


class ServiceLoop:
    def __init__(
        self,
        journal: Journal,
        metrics: Metrics,
        resolve: Resolve,
        intake: AttachmentIntake,
        routing: RoutingSettings | None = None,
        can_see: Callable[[str], bool] = sees,
    ) -> None:
        """``intake``: the calls' images and documents, decoded and stored (built by the
        composition root over the session log's store)."""
        self.journal = journal
        self._metrics = metrics
        self._resolve = resolve  # a target name → the Target that serves it
        self.routing = routing or RoutingSettings()
        self._sees = can_see  # a target name → whether it takes images and documents
        self.intake = intake

    async def _order(
        self, names: Sequence[str], call: Call, served: Served
    ) -> list[tuple[str, Quote[Any] | None]]:
        """``names`` in the order they are tried, each with its quote: cheapest first when
        every target can quote (else, and under ``routing.by: order``, the alias order).
        A first target that quotes nothing to pay (the local replicas at price 0) cannot
        be beaten: the rest are not quoted and follow in alias order."""
        alias: list[tuple[str, Quote[Any] | None]] = [(n, None) for n in names]
        if len(names) < 2 or self.routing.by == "order":
            return alias
        quotes: list[Quote[Any]] = []
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
        self,
        names: Sequence[str],
        call: Call,
        whole: bool = False,
        limits: Mapping[str, str] | None = None,
    ) -> Routed[Answer]:
        """The answer of the first target in ``names`` that serves ``call``, its first
        piece produced (each fallback is a request of its own, with an id of its own), and
        where it is served.  ``whole``: the answer is read to its end here, so a target
        that fails at any point before it ends falls back too.  ``limits``: the key's
        rate-limit headers, for the response."""
        return await self.first_answer_each(names, [call], None, whole, limits)

    async def first_answer_each(
        self,
        names: Sequence[str],
        calls: Sequence[Call],
        join: Join | None,
        whole: bool = False,
        limits: Mapping[str, str] | None = None,
    ) -> Routed[Answer]:
        """:meth:`first_answer` of a request served as the engine requests ``calls`` (a
        text completion's prompts, each with a request id of its own), their answers
        joined by ``join``; the request id is the first call's.  Several calls are not
        quoted: they go in alias order."""
        names = seeing(names, calls[0], self._sees)
        await self._take(calls)
        served = Served(limits=dict(limits or {}))
        order = await self._order(names, calls[0], served) if len(calls) == 1 else None
        tried = order or [(n, None) for n in names]
        for i, (name, quote) in enumerate(tried):
            attempt = [
                c if i == 0 else dataclasses.replace(c, request_id=f"{c.request_id}-{i}")
                for c in calls
            ]
            try:
                pieces = await primed(self._serve_each(name, attempt, served, join, quote))
                answer = Answer(attempt[0].request_id, await _drained(pieces) if whole else pieces)
                return Routed(answer, served)
            except APIError as exc:
                if i == len(tried) - 1 or not can_fall_back(exc):
                    raise
                reason = exc.code or exc.type
                log.warning("%s failed (%s: %s); trying %s", name, reason, exc, tried[i + 1][0])
                self._metrics.fallbacks.labels(name, reason).inc()
                served.fallback_from += (name,)
        raise AssertionError("no targets")  # Targets.resolve never returns an empty list

    def serve(self, name: str, call: Call, quote: Quote[Any] | None = None) -> Routed[Pieces]:
        """One target's answer (not started: the pieces run it) and where it is served:
        admitted, prepared, journaled, acquired, sent, settled; every claim given back on
        the way out (see the module)."""
        served = Served()
        return Routed(self._serve_each(name, [call], served, None, quote), served)

    async def _serve_each(
        self,
        name: str,
        calls: Sequence[Call],
        served: Served,
        join: Join | None = None,
        quote: Quote[Any] | None = None,
    ) -> Pieces:
        """One target's answer to a request served as the engine requests ``calls``:
        admitted once (as the one request they make), each prepared before any is
        journaled (one refused: nothing of the request is in the log or sent), then each
        journaled, acquired, sent, settled and released on its own (:meth:`_sent`), their
        answers joined by ``join`` (one call: its answer).  ``served`` says where the first
        went; ``quote``, the first's (one call only)."""
        seeing([name], calls[0], self._sees)  # a target that cannot see refuses by name
        await self._take(calls)  # done already when the call came through first_answer
        target = self._resolve(name)
        with target.admission(calls[0]):
            prepared: list[Prepared] = []
            for c in calls:
                prepared.append(await target.prepare(name, c, quote if len(calls) == 1 else None))
            served.target, served.notes = prepared[0].target, dict(prepared[0].notes)
            # several: they run at once, and the first piece waits for the first call to be
            # routed (``served``, the response's headers, is the first call's)
            placed = asyncio.Event() if len(calls) > 1 else None
            answers = [
                self._sent(target, c, p, served if i == 0 else None, placed if i == 0 else None)
                for i, (c, p) in enumerate(zip(calls, prepared, strict=True))
            ]
            if join is None and len(answers) > 1:
                raise ValueError("several engine requests need a join")
            async with aclosing(answers[0] if join is None else join(answers)) as pieces:
                async for piece in pieces:
                    if placed is not None and not placed.is_set():
                        await placed.wait()
                    yield piece

    async def _take(self, calls: Sequence[Call]) -> None:
        """Intake of the chats' images and documents (a text-only call: nothing)."""
        for c in calls:
            req = c.request
            if isinstance(req, ChatCompletionRequest) and next(req.attachment_parts(), None):
                with c.trace.step("intake"):
                    await self.intake.take(req)

    async def _sent(
        self,
        target: Target[Any],
        call: Call,
        p: Prepared,
        served: Served | None,
        placed: asyncio.Event | None = None,
    ) -> Pieces:
        """One engine request after its prepare: journaled, acquired, sent, settled, its
        answer journaled; what it claimed given back in one ``finally`` on every path.
        ``placed`` is set once it is routed (or will never be)."""
        op = self.journal.open(call.who.tenant, p.header, p.turns, call.session)
        held = [p]  # each Prepared this call had: what they claimed goes back below
        try:
            await self._journal(op, call, p)
            if served is not None and op is not None:
                served.session, served.session_kind = op.session_id, op.kind
            if op is not None and op.kind is not None:
                self._metrics.sessions.labels(op.kind).inc()
            p = await target.acquire(p)
            held.append(p)
            if served is not None:
                served.dispatch = p.placement
            if placed is not None:
                placed.set()
            answer, attempt = Sample(), 0
            while True:
                yielded = False
                try:
                    async with aclosing(target.send(p, op.session_id if op else None)) as out:
                        async for piece in out:
                            if piece.usage is not None:  # the end: all is known
                                await self._answered(op, call, answer, piece.usage)
                                if served is not None and op is not None:
                                    served.answer_seq = op.answer_seq
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
                    await self._journal(op, call, p)
        finally:
            if placed is not None:
                placed.set()
            for q in held:
                target.release(q)

    async def _journal(self, op: Any, call: Call, p: Prepared) -> None:
        """Record what ``p`` will send, before anything waits or is claimed for it."""
        with call.trace.step("journal"):
            s = p.sent
            await self.journal.sent(op, s.request_id, s.target, s.render, s.directives, s.body)

    async def _answered(
        self,
        op: Any,
        call: Call,
        answer: Sample,
        usage: Usage,
    ) -> None:
        """Journal the answer (sample 0, the one the conversation goes on with) before its
        usage goes out: its text and the tools it called."""
        await self.journal.sampled(op, call.request_id, answer, usage)


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
