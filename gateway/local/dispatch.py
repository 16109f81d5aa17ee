"""Route and dispatch: pick a replica (by predicted cached prefix), admit, stream, fold.

One path for every request, whichever edge it came from.  :meth:`Dispatcher.route`
is the local target's wait before a send (an index sync, room for a new session's
lease, a running prefill of the same prefix to join), and it ends with the one
claim routing makes: the prompt registered as a running prefill, which siblings
routed after it wait for.  The :class:`Dispatch` it returns is the receipt:
:meth:`Dispatcher.run` gives the registration back at the first token (or its
end), and :meth:`Dispatcher.release` on every other path (the service loop's
``finally``: a journal that failed, a client that left before the send, a
fallback).  Inside :meth:`Dispatcher.run`, what the send itself claims (the
replica's in-flight count, a place in its fair gate, the room keeper) is given
back in one ``finally``.

A warm request's prediction is the answer to a hold on its blocks
(:mod:`gateway.local.kv_holds`).  Routing awaits that answer, or, where the
replica's engine core takes a hold carried in its request and no running prefill
overlaps the request (:meth:`Dispatcher._hold_rides`), the hold rides in the
request (``GenerateRequest.hold``): the core takes it as it queues the request and
lets it go itself; :meth:`Dispatcher.run` reads its answer, the prediction, from the
first chunk before handing that on.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from array import array
from collections.abc import AsyncGenerator, Awaitable, Collection, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field, replace

from engines.base import EngineStats, GenerateChunk, GenerateRequest, RequestHold
from engines.errors import EngineError
from engines.lora import LoraRef
from gateway.core.config import Priority
from gateway.core.errors import NotFound, Unavailable, from_engine_error
from gateway.core.metrics import Metrics
from gateway.core.outputs import Usage
from gateway.core.tracing import RequestTrace
from gateway.core.types import RouteOverride
from gateway.local.admission import Admission
from gateway.local.coalesce import streamed
from gateway.local.fairness import Entry, FairGate, gates
from gateway.local.kv_holds import Hold, HoldResult
from gateway.local.preempt import Held, started
from gateway.local.prefills import Prefill, Prefills
from gateway.local.refresh import Refresh
from gateway.local.replica_set import ReplicaSet
from gateway.local.replicas import Replica
from gateway.local.room import MakeRoom, RoomKeeper
from gateway.local.routing import RouteContext, Router
from gateway.local.spans import KVSpans, image_spans
from gateway.local.ttft import Stamps, priority_class
from manifest.hashing import BlockHash, MMSpan
from manifest.index import LocationId

AFFINITY_TOKENS = 256  # a new prefix family is placed by its first tokens
MAX_REJOINS = 3  # prefills routed while a request held that it waits for, at most


def hash_tokens(tokens: Sequence[int]) -> int:
    return zlib.crc32(array("I", tokens).tobytes())


def prediction_result(d: Dispatch, actual: int) -> tuple[str, str]:
    """``d``'s prediction against the ``actual`` cached tokens vLLM reported: (result,
    cause).  ``approximate`` with why it was; ``missed`` when it said exact and was
    wrong (``evicted``: it read less; ``stored_since``: more); ``exact`` otherwise."""
    if d.approximate:
        return "approximate", d.approximate
    predicted = d.predicted_cached_tokens or 0
    if actual == predicted:
        return "exact", ""
    return "missed", "evicted" if actual < predicted else "stored_since"


@dataclass(frozen=True)
class Totals:
    """A request's count at its end, :meth:`Dispatcher.run`'s last output."""

    prompt: int = 0
    cached: int = 0
    completion: int = 0
    finish_reason: str = "stop"
    phases: Mapping[str, float] | None = None  # where its TTFT went (gateway/local/ttft.py)

    def usage(self) -> Usage:
        return Usage.of(self.prompt, self.completion, self.cached)


@dataclass
class Dispatch:
    """Where a request goes and what the manifest predicted it will find there.

    With a hold carried in the request (``carried``), the prediction is the index's
    and ``approximate`` is ``"hold_pending"`` until :meth:`Dispatcher.run` reads the
    hold's answer, before it hands on the first chunk: then both are the engine's, as
    routing sets them after a hold it awaited.  Read after the first chunk (headers,
    usage, the prediction's record), they are final."""

    replica: Replica = field(repr=False)
    replica_id: str
    predicted_cached_tokens: int | None  # None: no exact prediction for this replica
    hashes: Sequence[BlockHash] = ()  # the prompt's full blocks (empty without a KV index)
    # its prompt as a running prefill, from routing to its first token (others may wait),
    # and the hold on the blocks it reads: the claims this receipt gives back
    # (Dispatcher.run at the first token, else release)
    prefill: Prefill | None = field(default=None, compare=False, repr=False)
    # why the prediction may still be wrong ("": exact: its blocks held, or none to read
    # and no prefill of them running)
    approximate: str = ""
    # the hold its request carries (Dispatcher.run sends it in the request; from then on
    # the engine core owns it: nothing to give back)
    carried: RequestHold | None = field(default=None, compare=False, repr=False)

    def headers(self) -> dict[str, str]:
        h = {"x-vcache-replica": self.replica_id}
        if self.predicted_cached_tokens is not None:
            h["x-vcache-predicted-cached-tokens"] = str(self.predicted_cached_tokens)
            h["x-vcache-prediction"] = "approximate" if self.approximate else "exact"
        return h


class Dispatcher:
    def __init__(
        self,
        replicas: ReplicaSet,
        router: Router,
        metrics: Metrics,
        max_inflight: int,
        model: str = "local",
        room: Mapping[Priority, int] | None = None,
        prefill_wait_s: float = 30.0,
        slots: int | None = None,
        first_token_guard: bool = False,
        prefill_slots: dict[int, int] | None = None,
        preempt_prefills: bool = False,
        refresh: bool = False,
        make_room: MakeRoom | None = None,
        hold_share: float = 0.0,
        hold_s: float = 10.0,
    ) -> None:
        """``replicas``: the set the supervisor starts and restarts (its readiness and
        the KV spans attached at boot are read from it); ``make_room``: room in a
        replica's KV for a request before it starts (``SessionTurns.make_room``: paused
        sessions' leases give way to live requests); ``hold_share``: the most of a
        replica's KV blocks routed requests' holds may keep (0: no holds, predictions
        approximate), each for at most ``hold_s``."""
        self.replica_set = replicas
        self.router = router
        self._metrics = metrics
        self.admission = Admission(max_inflight, room, metrics)  # queue_full, by priority
        self.admit = self.admission.admit
        self.model = model  # the served name: the ``model`` label of the local metrics
        self.prefills = Prefills(prefill_wait_s)  # prompts being prefilled, by replica
        self._prefill_wait_s = prefill_wait_s
        # per replica, the requests its engine takes at once, the rest in fair order
        gated = slots is not None or first_token_guard or bool(prefill_slots)
        shares = {r.id: r.shares for r in replicas.replicas}
        self._gates: dict[LocationId, FairGate] = (
            gates(shares, slots, first_token_guard, prefill_slots, preempt_prefills)
            if gated
            else {}
        )
        self.make_room = make_room
        self._refresh_on = refresh  # predicted blocks touched before the request runs
        self._refresh: Refresh | None = None
        self._hold_share = hold_share
        self._hold_s = hold_s

    @property
    def replicas(self) -> list[Replica]:
        return self.replica_set.replicas

    @property
    def kv(self) -> KVSpans | None:
        """The exact KV spans the boot attached (None: none, or not yet)."""
        return self.replica_set.kv

    def serving(self) -> list[Replica]:
        """The replicas that can take a request now (a dead one is being restarted)."""
        return self.replica_set.serving()

    def replica_stats(self) -> dict[str, EngineStats]:
        """What each replica's engine holds now (the metrics read it at scrape time)."""
        return {r.id: r.engine.stats() for r in self.replicas}

    def held(
        self,
        prompt: Sequence[int],
        cache_salt: str | None,
        lora: LoraRef | None = None,
        mm: Sequence[MMSpan] = (),
    ) -> int:
        """The most of ``prompt``'s tokens a serving replica holds in cache now, by the
        exact index as it stands (no sync, nothing routed: a quote); 0 without one."""
        if self.kv is None:
            return 0
        predicted = self.kv.predict(self.kv.hashes(prompt, cache_salt, lora, mm), len(prompt))
        serving = {r.id for r in self.serving()}
        return max((n for r, n in predicted.items() if r in serving), default=0)

    def replica(self, replica_id: str) -> Replica | None:
        return self.replica_set.replica(replica_id)

    def forced(self, override: RouteOverride | None) -> Replica | None:
        """An admin's forced replica (None: the router chooses); 404 when it is unknown.
        Asked before the journal (a request refused here leaves nothing in the log) and
        again by :meth:`route`."""
        if override is None or override.replica is None:
            return None
        forced = self.replica(override.replica)
        if forced is None:
            raise NotFound(
                f"Unknown replica '{override.replica}'",
                param="x-vcache-replica",
                code="replica_not_found",
            )
        return forced

    async def route(
        self,
        greq: GenerateRequest,
        override: RouteOverride | None,
        session: LocationId | None = None,
        lease_blocks: int | None = None,
        among: Collection[LocationId] = (),
    ) -> Dispatch:
        """The replica for ``greq``: the router's choice over the serving replicas (those
        of them in ``among`` when any is: the replicas that hold ``greq``'s adapter; an
        admin's forced replica aside); ``session``, the replica of the session's last turn;
        ``lease_blocks``, for a new session's turn, the blocks its lease is expected to hold
        (the prompt's, if more): the router weighs each replica's pin budget left.

        It waits: the index sync, each replica's pin budget (a new session's turn), and
        (bounded) a running prefill of the same prefix on the chosen replica.  Then, with
        no await after it, it claims: ``greq``'s prompt is registered as a running
        prefill (``Dispatch.prefill``).  The caller owns that receipt: :meth:`run` gives
        it back at the first token, :meth:`release` wherever ``run`` never starts."""
        predicted: dict[LocationId, int] | None = None
        hashes: list[BlockHash] = []
        affinity = hash_tokens(greq.prompt_token_ids[:AFFINITY_TOKENS])
        pending: dict[LocationId, tuple[int, Prefill]] = {}
        view: dict[LocationId, int] | None = None  # what routing sees: stored or being stored
        if self.kv is not None:
            await self.kv.sync()
            hashes = self.kv.hashes(
                greq.prompt_token_ids, greq.cache_salt, greq.lora, image_spans(greq)
            )
            predicted = self.kv.predict(hashes, greq.num_prompt_tokens)
            pending = self.prefills.overlap(hashes[: self._cap(greq)])
            bs = self.kv.block_size
            view = {
                r: max(n, pending[r][0] * bs if r in pending else 0) for r, n in predicted.items()
            }
        forced = self.forced(override)
        if forced is not None:
            replica = forced
        else:
            policy = override.policy if override is not None else None
            serving = self.serving()
            if not serving:
                raise Unavailable(
                    "the local engine is not running; it is being restarted",
                    code="engine_unavailable",
                    retry_after_s=self.replica_set.retry_after_s(),
                )
            holding = [r for r in serving if r.id in among]
            serving = holding or serving
            ctx = RouteContext(view, affinity, session)
            if lease_blocks is not None and session is None and view is not None:
                ctx = await self._with_room(ctx, serving, max(lease_blocks, len(hashes)))
            replica = self.router.choose(serving, ctx, policy)
        running = False  # a prefill of its blocks still running when it goes
        reads = greq.sampling.reads_prefix_cache  # else vLLM reads none of them: 0, exact
        if predicted is not None and reads and replica.id in pending:
            predicted, running = await self._join(
                greq, hashes, predicted, replica.id, pending[replica.id]
            )
        exact = self.kv is not None and self.kv.is_exact(replica.id)
        p: int | None = None
        hold: Hold | RequestHold | None = None
        approximate = ""
        if predicted is not None and exact and replica.id in predicted:
            if reads:
                p, hold, approximate = await self._predict(
                    greq, replica, hashes, predicted, running
                )
            else:
                p = 0
        carried = hold if isinstance(hold, RequestHold) else None
        held = hold if isinstance(hold, Hold) else None
        # registered now, with no await before the caller holds it: a sibling routed next
        # waits for this prefill
        prefill = self.prefills.start(replica.id, hashes[: self._cap(greq)], held)
        return Dispatch(replica, replica.id, p, hashes, prefill, approximate, carried)

    async def _predict(
        self,
        greq: GenerateRequest,
        replica: Replica,
        hashes: Sequence[BlockHash],
        predicted: Mapping[LocationId, int],
        running: bool,
    ) -> tuple[int, Hold | RequestHold | None, str]:
        """``greq``'s prediction on ``replica`` from the facts vLLM will schedule it on: the
        leading blocks its engine holds for it (:meth:`_hold`), and the prefills routed
        there before it, which vLLM schedules first.  One of those that stores more of its
        blocks than are held (routed while this request's hold was on its way, or one
        :meth:`route` did not wait for because the index listed as many blocks as it would
        store) would be read too: the hold is given back, the request waits for that
        prefill's first token and is predicted and held again.  With no await between
        the last look at the running prefills and the caller's registration, a sibling
        routed after it finds it registered.  Where the hold can ride in the request
        (:meth:`_hold_rides`), nothing is awaited: the prediction is the index's
        until :meth:`run` reads the hold's answer.  (prediction, hold, why approximate
        or "")."""
        assert self.kv is not None
        bs = self.kv.block_size
        blocks = hashes[: self._cap(greq)]
        joins = 0
        while True:
            p = predicted.get(replica.id, 0)
            if self._hold_rides(replica, blocks, p, running):
                return p, self._carried(replica, blocks), "hold_pending"
            p, hold, approximate = await self._hold(greq, replica, hashes, p)
            if running:
                return p, hold, "prefill_in_flight"
            later = self.prefills.overlap(blocks).get(replica.id)
            if later is None or later[0] * bs <= p:
                return p, hold, approximate
            if joins == MAX_REJOINS:
                return p, hold, "prefill_in_flight"
            joins += 1
            if hold is not None:
                hold.give()
            predicted, running = await self._join(greq, hashes, {replica.id: p}, replica.id, later)

    def _hold_rides(
        self, replica: Replica, blocks: Sequence[BlockHash], predicted: int, running: bool
    ) -> bool:
        """Whether the hold on ``blocks`` rides in its request instead of being awaited
        while routing: a warm prediction to hold, on an engine whose core takes a hold
        carried in its request (taken as the core queues the request: the same guarantee,
        one engine step sooner, with no core call, reply or release), and no running
        prefill of these blocks on ``replica``.  Then nothing routed before this request
        will store blocks it reads: none was running when it looked, and it registers
        with no await after that look, so a sibling routed after it finds it and waits
        for its first token.  Otherwise (a remote replica, a prefill to join or racing
        it, no holds) the hold is awaited here as before.  That includes a running
        prefill that overlaps only resident blocks (a sibling of the same system prompt):
        the one engine step the awaited hold costs staggers siblings, which made the
        streamed TTFT shorter than sending that hold with the request too (the runs:
        docs/notebook_frontend.md)."""
        assert self.kv is not None
        return (
            self._hold_share > 0
            and predicted > 0
            and not running
            and self.kv.holds.in_request(replica.id)
            and replica.id not in self.prefills.overlap(blocks)
        )

    def _carried(self, replica: Replica, blocks: Sequence[BlockHash]) -> RequestHold:
        return RequestHold(
            tuple(bytes(h) for h in blocks), self._hold_share, self._reserve(replica), self._hold_s
        )

    def _reserve(self, replica: Replica) -> int:
        """The free blocks a hold must leave on ``replica``: its longest request's."""
        bs = self.kv.block_size if self.kv is not None else 1
        return -(-replica.engine.capabilities.max_model_len // bs)

    async def _hold(
        self, greq: GenerateRequest, replica: Replica, hashes: Sequence[BlockHash], predicted: int
    ) -> tuple[int, Hold | None, str]:
        """Hold the blocks ``greq`` reads on ``replica`` until its first token: (its
        prediction, the hold, why the prediction is approximate or "").  The engine's
        answer is the prediction: its leading resident blocks, held from now on, so no
        eviction before vLLM schedules it changes what it reads.  A cold prediction
        holds nothing (no eviction can make it wrong); a refused or failed hold leaves
        the index's prediction, approximate."""
        assert self.kv is not None
        if self._hold_share <= 0:
            return predicted, None, "no_hold"
        if predicted == 0:
            return 0, None, ""
        m = self._metrics
        res = await self.kv.holds.take(
            replica.id,
            hashes[: self._cap(greq)],
            self._hold_share,
            self._reserve(replica),
            self._hold_s,
            lambda h, s: m.kv_hold_seconds.observe(s),
        )
        return self._held(replica.id, res, predicted)

    def _held(
        self, replica: LocationId, res: HoldResult, predicted: int
    ) -> tuple[int, Hold | None, str]:
        """A hold's answer, counted: (the prediction, the hold, why approximate or "")."""
        assert self.kv is not None
        m = self._metrics
        outcome = "held" if res.blocks else res.refused or "none"
        m.kv_holds.labels(replica, outcome).inc()
        if res.blocks is None:
            return predicted, None, f"hold_{res.refused}"
        m.kv_hold_blocks.labels(replica).inc(res.blocks)
        return res.blocks * self.kv.block_size, res.hold, ""

    def _answered(self, d: Dispatch, chunk: GenerateChunk) -> None:
        """The answer to the hold ``d``'s request carried, from its first chunk: ``d``'s
        prediction from now on (the engine's count, as :meth:`_hold` makes it).  No
        answer (an engine that lost it) leaves the index's prediction, approximate."""
        answer = chunk.hold
        if answer is None:
            res = HoldResult(None, None, "unanswered")
        else:
            blocks, refused = answer
            res = HoldResult(None, None if refused else blocks, refused)
        p, _, d.approximate = self._held(d.replica.id, res, d.predicted_cached_tokens or 0)
        d.predicted_cached_tokens = p

    def release(self, d: Dispatch) -> None:
        """Give back what routing claimed for ``d`` (its prompt's registration as a
        running prefill, the hold on its blocks awaited while routing): a request whose
        send never ran makes nobody wait.  Idempotent: after :meth:`run` gave it back at
        the first token, nothing is left.  A hold carried in the request is the engine
        core's to let go."""
        self.prefills.finish(d.prefill)

    async def _with_room(
        self, ctx: RouteContext, serving: Sequence[Replica], blocks: int
    ) -> RouteContext:
        """``ctx`` with each serving replica's pin budget left (in tokens) beside the
        session's expected lease; unchanged where a replica's budget is not known."""
        assert self.kv is not None
        bs = self.kv.block_size
        room: dict[LocationId, int] = {}
        for r in serving:
            left = await self.kv.pin_room(r.id)
            if left is None:
                return ctx
            room[r.id] = left * bs
        return replace(ctx, lease_tokens=blocks * bs, lease_room=room)

    def _blocks(self, greq: GenerateRequest) -> int:
        """The KV blocks ``greq`` holds at its longest: its prompt and its answers."""
        bs = self.kv.block_size if self.kv is not None else 1
        s = greq.sampling
        return -(-greq.num_prompt_tokens // bs) + s.n * -(-s.max_tokens // bs)

    def _cap(self, greq: GenerateRequest) -> int:
        """Full blocks vLLM can serve from cache for ``greq`` (never its last token)."""
        bs = self.kv.block_size if self.kv is not None else 1
        return max(greq.num_prompt_tokens - 1, 0) // bs

    async def _join(
        self,
        greq: GenerateRequest,
        hashes: Sequence[BlockHash],
        predicted: dict[LocationId, int],
        replica: LocationId,
        pending: tuple[int, Prefill],
    ) -> tuple[dict[LocationId, int], bool]:
        """Wait (bounded) for the running prefill whose blocks this request would read, then
        predict again: the engine has stored them and the index has seen them.  With
        whether that prefill is still running (the wait ran out): what the request reads
        of its blocks then depends on which of the two vLLM schedules first."""
        assert self.kv is not None
        blocks, running = pending
        if blocks * self.kv.block_size <= predicted.get(replica, 0):
            return predicted, False  # the index holds as much already
        try:
            await asyncio.wait_for(running.done.wait(), self._prefill_wait_s)
            outcome = "joined"
        except TimeoutError:
            outcome = "timeout"
        self._metrics.prefill_waits.labels(outcome).inc()
        await self.kv.sync()
        return self.kv.predict(hashes, greq.num_prompt_tokens), not running.done.is_set()

    async def run(
        self,
        greq: GenerateRequest,
        d: Dispatch,
        endpoint: str,
        t0: float,
        trace: RequestTrace | None = None,
    ) -> AsyncGenerator[GenerateChunk | Totals, None]:
        """Stream from the chosen replica (inside :meth:`admit`): the engine's chunks,
        then, last, the request's :class:`Totals`.  Until its first token, its prompt is a
        running prefill others may wait for; the blocks it was predicted to read are the
        last its replica evicts.  What it claims (the replica's in-flight count, a place in
        the fair gate, the room keeper) and ``d``'s prefill registration are given back in
        one ``finally``, however it ends (also cancelled while it waits for room or for its
        place).  ``trace``: its ``dispatch`` step ends at the first token (with the TTFT's
        phases), its ``generate`` step at the last."""
        stamps = Stamps(t0, time.perf_counter())
        gate = self._gates.get(d.replica.id)
        held = Held(None)  # its place in the gate: a higher class may stop its prefill
        keeper: RoomKeeper | None = None
        counted = False  # in the replica's in-flight count
        prompt = cached = completion = 0
        finish = "stop"
        phases: dict[str, float] | None = None
        m = self._metrics
        if trace is not None:
            trace.begin("dispatch", replica=d.replica_id)
        try:
            if self._may_wait(d, gate, greq.priority) and self._touch(d):
                await asyncio.sleep(0)  # the touch is sent before the request
            if self.make_room is not None and self.kv is not None:
                await self.make_room(self.kv, d.replica.id, d.hashes, self._blocks(greq))
            d.replica.inflight += 1
            counted = True
            tenant = greq.tenant or greq.cache_salt or ""  # a client's own salt is not a tenant
            if gate is not None:
                waits = not gate.free(greq.priority)
                held.entry = await self._enter(gate, greq, d, tenant)
                if waits and self._touch(d):  # others ran meanwhile: touched again
                    await asyncio.sleep(0)
            if self.make_room is not None and self.kv is not None:
                keeper = RoomKeeper(
                    self.make_room,
                    self.kv,
                    d.replica.id,
                    d.hashes,
                    self._blocks(greq),
                    greq.request_id,
                )

            def send() -> AsyncGenerator[GenerateChunk, None]:
                stamps.send()
                if d.carried is None:
                    return d.replica.engine.generate(greq)
                # each send carries it: a request sent again after a stop was aborted,
                # and its hold let go, in the core
                return d.replica.engine.generate(replace(greq, hold=d.carried))

            def enter(g: FairGate) -> Awaitable[Entry]:
                return self._enter(g, greq, d, tenant)

            stops = m.prefill_stops.labels(d.replica_id)
            try:
                stream, chunk = await started(send, gate, held, enter, stops.inc)
                async with aclosing(stream):
                    if chunk is not None:  # the first token: the prefill is done
                        last = time.perf_counter()
                        phases = stamps.phases(chunk.core_times, last)
                        ph = phases or {}
                        if d.carried is not None:  # answered with the request's first output
                            self._answered(d, chunk)
                        self._first_output(d, chunk, endpoint, last - t0, greq.priority, ph)
                        self.release(d)
                        if keeper is not None:
                            keeper.cancel()
                        if gate is not None and held.entry is not None:
                            gate.first_token(held.entry)
                        prompt = chunk.num_prompt_tokens
                        if chunk.num_cached_tokens is not None:
                            # embedded engines know it at the first token, remote ones later
                            cached = self._cached(d, chunk.num_cached_tokens, held.stops)
                        completion = len(chunk.token_ids)
                        finish = chunk.finish_reason or finish
                        if trace is not None:
                            attrs = {f"ttft.{k}_s": v for k, v in ph.items()}
                            trace.finish("dispatch", cached_tokens=cached, **attrs)
                            trace.begin("generate")
                        yield chunk
                        itl = m.inter_token.labels(self.model, "local", d.replica_id)
                        # an answer sent whole comes in its first output and its last: no
                        # gap to time; a streamed one's outputs are, coalesced or not
                        per_token = streamed(greq.sampling)
                        cached_known = chunk.num_cached_tokens is not None
                        async for chunk in stream:  # the per-token path: kept lean
                            n = len(chunk.token_ids)
                            if per_token:
                                now = time.perf_counter()
                                itl.observe((now - last) / max(n, 1))  # a coalesced output's
                                last = now  # gap is its tokens' (the engine merged them)
                            if not cached_known and chunk.num_cached_tokens is not None:
                                cached = self._cached(d, chunk.num_cached_tokens, held.stops)
                                cached_known = True
                            completion += n
                            if chunk.finish_reason is not None:
                                finish = chunk.finish_reason
                            yield chunk
            except EngineError as exc:
                raise from_engine_error(exc) from exc
            except (GeneratorExit, asyncio.CancelledError):
                m.aborted.labels(endpoint).inc()  # the client went away
                raise
            if trace is not None:
                trace.finish("generate", completion_tokens=completion)
            yield Totals(prompt, cached, completion, finish, phases)
        finally:
            if counted:
                d.replica.inflight -= 1
            self.release(d)
            if keeper is not None:
                keeper.cancel()
            if gate is not None and held.entry is not None:
                gate.leave(held.entry, completion)
            if prompt:  # counted once a request, not per token
                m.prompt_tokens.labels(self.model, d.replica_id).inc(prompt)
            if completion:
                m.completion_tokens.labels(self.model, d.replica_id).inc(completion)

    def _cached(self, d: Dispatch, cached: int, stops: int) -> int:
        """The engine reported ``cached`` prompt tokens read from its prefix cache: counted,
        and folded into the prediction's record (not after a stopped prefill, which stored
        blocks since routing)."""
        self._metrics.cached_tokens.labels(self.model, d.replica_id).inc(cached)
        if not stops:
            self._fold_prediction(d, cached)
        return cached

    @staticmethod
    def _may_wait(d: Dispatch, gate: FairGate | None, priority: int) -> bool:
        """Whether ``d``'s blocks are touched before its send: unless its request carries
        its hold and its slot is free.  Then the core takes the hold as it queues the
        request, at the step boundary the touch would reach, and keeps the blocks out of
        the free queue, where a touch only moves them to the far end: one core call a
        request less.  (A hold the core refuses, past its share of the blocks, leaves them
        where they are for the steps until the request is scheduled.)  A request that
        may wait for its slot is touched first, and again after the wait."""
        return d.carried is None or (gate is not None and not gate.free(priority))

    def _touch(self, d: Dispatch) -> bool:
        """Touch the blocks ``d`` predicts its request reads (False: nothing to touch)."""
        if not self._refresh_on or self.kv is None or not d.predicted_cached_tokens:
            return False
        if self._refresh is None:
            count = self._metrics.refreshed_blocks
            self._refresh = Refresh(self.kv, lambda r, x, n: count.labels(r, x).inc(n))
        return self._refresh.touch(d.replica.id, d.hashes, d.predicted_cached_tokens)

    async def settle(self) -> None:
        """Wait for the touches under way (before the spans close)."""
        if self._refresh is not None:
            await self._refresh.settle()

    async def _enter(
        self, gate: FairGate, greq: GenerateRequest, d: Dispatch, tenant: str
    ) -> Entry:
        """A slot in the replica's engine, in fair order; charged the prefill it computes."""
        cost = greq.num_prompt_tokens - (d.predicted_cached_tokens or 0)
        if not gate.free(greq.priority):
            self._metrics.fair_waits.labels(d.replica_id).inc()
        return await gate.enter(tenant, greq.priority, cost)

    def _first_output(
        self,
        d: Dispatch,
        chunk: GenerateChunk,
        endpoint: str,
        ttft_s: float,
        priority: int,
        phases: Mapping[str, float],
    ) -> None:
        """The engine prefilled the prompt: its blocks are stored (see ``KVSpans.answered``)."""
        if self.kv is not None:
            self.kv.answered(d.replica.id, d.hashes)
        m = self._metrics
        m.ttft.labels(endpoint, self.model, "local", d.replica_id).observe(ttft_s)
        for phase, s in phases.items():
            m.ttft_phase.labels(phase, priority_class(priority)).observe(s)
        if (core := chunk.core_times) is not None:  # queued → scheduled in the engine core
            m.queue_time.labels(self.model, d.replica_id).observe(core.scheduled_s - core.queued_s)

    def _fold_prediction(self, d: Dispatch, actual: int) -> None:
        if d.predicted_cached_tokens is None or self.kv is None:
            return
        matched = self.kv.record_outcome(d.replica.id, d.predicted_cached_tokens, actual)
        self._metrics.predictions.labels("matched" if matched else "missed").inc()
        self._metrics.prediction_results.labels(*prediction_result(d, actual)).inc()
