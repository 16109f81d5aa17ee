"""Predictions under concurrency: the two races between routing and scheduling.

A prediction presented as exact (``x-vcache-prediction: exact``; before the header
existed, every prediction was presented so) must equal what the engine serves.

- A sibling in flight: a request routed while another prefill of its prefix runs on
  its replica is served the blocks that prefill stores before it is scheduled.
- An eviction between routing and scheduling: requests that run meanwhile take the
  least recently used free blocks, the predicted ones among them, unless held.

The engine below behaves as vLLM and the vcache plugin do for these races: a prefix
cache, holds that keep blocks from eviction (all or nothing, bounded), a request that
reads its leading resident blocks when it is scheduled and stores all of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from engines.base import GenerateRequest, SamplingOptions
from gateway.core.metrics import Metrics
from gateway.local.dispatch import MAX_REJOINS, Dispatch, Dispatcher, prediction_result
from gateway.local.replicas import Replica
from gateway.local.routing import Router
from gateway.local.spans import KVSpans
from manifest.hashing import block_hashes
from manifest.index import LocationId
from tests.unit.builders import booted

R = LocationId("replica-0")
BS = 16
SYSTEM = list(range(BS * 3))  # three shared blocks
A_PROMPT = (*SYSTEM, *range(1000, 1000 + BS + 5))
B_PROMPT = (*SYSTEM, *range(2000, 2000 + BS + 5))
SHARED = block_hashes(SYSTEM, BS, "0")


class SimEngine:
    """One replica's engine core: its prefix cache, the plugin's holds, its scheduler's
    reads.  ``num_blocks`` KV blocks; holds refused past ``max_share`` of them."""

    ready = True

    def __init__(
        self,
        resident: Sequence[bytes],
        num_blocks: int = 64,
        fail: bool = False,
        round_trip: bool = False,
    ) -> None:
        self.resident = {bytes(h) for h in resident}
        self.num_blocks = num_blocks
        self.fail = fail  # an engine that cannot hold (an older plugin, a dead core)
        # a hold answered between two engine steps: other requests route meanwhile
        self.round_trip = round_trip
        self.held: dict[bytes, int] = {}
        self.holds: dict[str, list[bytes]] = {}
        self.capabilities = SimpleNamespace(max_model_len=2048, block_size=BS)

    async def call_core(self, method: str, *args: Any) -> Any:
        if method == "vcache_events_barrier":
            return -1
        if self.fail:
            raise RuntimeError(f"no {method} here")
        if method == "vcache_hold":
            hold_id, hashes, max_share, _reserve, _ttl = args
            if self.round_trip:
                await asyncio.sleep(0)
            prefix: list[bytes] = []
            for h in hashes:
                if h not in self.resident:
                    break
                prefix.append(h)
            new = [h for h in prefix if h not in self.held]
            if len(self.held) + len(new) > int(self.num_blocks * max_share):
                return {"held": 0, "refused": "budget"}
            for h in prefix:
                self.held[h] = self.held.get(h, 0) + 1
            if prefix:
                self.holds[hold_id] = prefix
            return {"held": len(prefix), "refused": ""}
        if method == "vcache_release":
            for hold_id in args[0]:
                for h in self.holds.pop(hold_id, []):
                    self.held[h] -= 1
                    if not self.held[h]:
                        del self.held[h]
            return {"freed": 0}
        raise AssertionError(method)

    def pressure(self) -> None:
        """Requests that ran meanwhile took every free block: what no hold keeps is gone."""
        self.resident &= set(self.held)

    def schedule(self, prompt: tuple[int, ...]) -> int:
        """vLLM schedules the request: the cached tokens it reads (its leading resident
        full blocks, never its last token); its prompt's blocks are stored."""
        hashes = [bytes(h) for h in block_hashes(list(prompt), BS, "0")]
        cap = (len(prompt) - 1) // BS
        n = 0
        while n < cap and hashes[n] in self.resident:
            n += 1
        self.resident |= set(hashes)
        return n * BS


def _dispatcher(engine: SimEngine, tmp_path: Path, **options: Any) -> tuple[Dispatcher, KVSpans]:
    kv = KVSpans(BS, "0", pin_max_share=0.5, default_lease_s=60, holder="gw")
    kv.attach(R, engine, f"ipc://{tmp_path}/events", None)  # type: ignore[arg-type]
    kv.index.apply_stored(R, [h for h in SHARED if bytes(h) in engine.resident])
    kv.state(R).agreement = "exact"  # as its start probe found
    options = {"max_inflight": 8, "hold_share": 0.25, **options}
    replicas = booted([Replica(R, engine)], kv)  # type: ignore[arg-type]
    return Dispatcher(replicas, Router(), Metrics(), **options), kv


def _greq(rid: str, prompt: tuple[int, ...]) -> GenerateRequest:
    return GenerateRequest(rid, prompt, SamplingOptions(max_tokens=1))


def _claimed_exact(d: Dispatch) -> bool:
    return d.headers().get("x-vcache-prediction", "exact") == "exact"


def _honest(d: Dispatch, served: int) -> bool:
    """An exact prediction equals what the engine served (an approximate one may not)."""
    return not _claimed_exact(d) or d.predicted_cached_tokens == served


def test_an_eviction_between_routing_and_scheduling(tmp_path: Path) -> None:
    """Routed with three blocks resident; before vLLM schedules it, pressure evicts every
    free block.  Held, its three blocks stay: predicted 48, served 48."""

    async def main() -> None:
        engine = SimEngine(SHARED)
        d, kv = _dispatcher(engine, tmp_path)
        b = await d.route(_greq("b", B_PROMPT), None)
        engine.pressure()
        served = engine.schedule(B_PROMPT)
        d.release(b)  # its first token (or its end): the hold is given back
        await kv.close()
        assert b.predicted_cached_tokens == 3 * BS
        assert _honest(b, served), (b.headers(), served)
        assert served == 3 * BS and _claimed_exact(b)
        assert engine.holds == {}  # released in the engine

    asyncio.run(main())


def test_a_sibling_in_flight(tmp_path: Path) -> None:
    """A is routed and prefilling the shared blocks; B, routed now, is sent before A has
    stored them (its wait for A ran out).  vLLM schedules A first: B reads A's blocks.
    B's prediction (the index's: nothing yet) cannot be exact, and says so."""

    async def main() -> None:
        engine = SimEngine([])
        d, kv = _dispatcher(engine, tmp_path, prefill_wait_s=0.2)  # the timeout is the case
        a = await d.route(_greq("a", A_PROMPT), None)
        b = await d.route(_greq("b", B_PROMPT), None)
        engine.schedule(A_PROMPT)  # A's prefill stores the shared blocks
        served = engine.schedule(B_PROMPT)
        d.release(a)
        d.release(b)
        await kv.close()
        assert served == 3 * BS
        assert _honest(b, served), (b.headers(), served)
        assert b.headers()["x-vcache-prediction"] == "approximate"
        assert prediction_result(b, served) == ("approximate", "prefill_in_flight")

    asyncio.run(main())


def test_a_sibling_joined_is_predicted_with_its_blocks_and_holds_them(tmp_path: Path) -> None:
    """B waits for A's prefill (the same facts route and join it: A's pending blocks),
    then is predicted, and held, with the blocks A stored: exact under pressure too."""

    async def main() -> None:
        engine = SimEngine([])
        d, kv = _dispatcher(engine, tmp_path)
        a = await d.route(_greq("a", A_PROMPT), None)
        routing = asyncio.create_task(d.route(_greq("b", B_PROMPT), None))
        await asyncio.sleep(0)  # B is waiting for A's prefill
        assert not routing.done()
        engine.schedule(A_PROMPT)
        kv.index.apply_stored(R, block_hashes(list(A_PROMPT), BS, "0"))  # A's KV events
        d.release(a)  # A's first token
        b = await routing
        engine.pressure()
        served = engine.schedule(B_PROMPT)
        d.release(b)
        await kv.close()
        assert (b.predicted_cached_tokens, served) == (3 * BS, 3 * BS)
        assert _claimed_exact(b)

    asyncio.run(main())


def test_siblings_routed_together_meet_on_one_prefill(tmp_path: Path) -> None:
    """A and B share three blocks, two resident; both are routed at once, each holding
    while the other routes (a hold is a round trip to the engine core).  Neither was
    registered when the other looked, yet A will store the third block before vLLM
    schedules B: B, seeing A registered once its hold is answered, waits for A's
    prefill and is predicted (and held) with all three.  Before, both went with two
    blocks predicted exact, and B was served three (missed: stored_since)."""

    async def main() -> None:
        engine = SimEngine(SHARED[:2], round_trip=True)
        d, kv = _dispatcher(engine, tmp_path)
        routing_a = asyncio.create_task(d.route(_greq("a", A_PROMPT), None))
        routing_b = asyncio.create_task(d.route(_greq("b", B_PROMPT), None))
        a = await routing_a
        for _ in range(5):  # B's hold is answered: it finds A registered, and waits for it
            await asyncio.sleep(0)
        waited = not routing_b.done()
        served_a = engine.schedule(A_PROMPT)  # A's prefill stores the third block
        kv.index.apply_stored(R, block_hashes(list(A_PROMPT), BS, "0"))  # its KV events
        d.release(a)  # A's first token
        b = await routing_b
        served_b = engine.schedule(B_PROMPT)
        d.release(b)
        await kv.close()  # before any assert: its sockets would keep the interpreter alive
        assert (a.predicted_cached_tokens, served_a) == (2 * BS, 2 * BS)
        assert _honest(a, served_a) and _honest(b, served_b), (b.headers(), served_b)
        assert (b.predicted_cached_tokens, served_b) == (3 * BS, 3 * BS)
        assert _claimed_exact(b) and waited

    asyncio.run(main())


def test_a_prefill_the_index_covers_but_the_engine_does_not(tmp_path: Path) -> None:
    """The index still lists the third shared block, which the engine has evicted (its
    event not folded yet).  A, routed, holds two and will compute the third.  B routed
    next sees A's prefill, but no more blocks in it than the index lists, so it did not
    wait; its hold finds two.  A stores the third before vLLM schedules B: B must wait
    for A (the engine's count, not the index's, decides), and is predicted three."""

    async def main() -> None:
        engine = SimEngine(SHARED[:2])
        d, kv = _dispatcher(engine, tmp_path)
        kv.index.apply_stored(R, SHARED)  # stale: the third is gone from the engine
        a = await d.route(_greq("a", A_PROMPT), None)
        routing_b = asyncio.create_task(d.route(_greq("b", B_PROMPT), None))
        for _ in range(5):  # B holds two, finds A storing three, and waits for it
            await asyncio.sleep(0)
        waited = not routing_b.done()
        served_a = engine.schedule(A_PROMPT)
        d.release(a)
        b = await routing_b
        served_b = engine.schedule(B_PROMPT)
        d.release(b)
        await kv.close()
        assert a.predicted_cached_tokens == served_a == 2 * BS
        assert _honest(b, served_b), (b.headers(), served_b)
        assert (b.predicted_cached_tokens, served_b) == (3 * BS, 3 * BS)
        assert waited

    asyncio.run(main())


def test_waits_for_prefills_routed_meanwhile_are_bounded(tmp_path: Path) -> None:
    """B waits for a running prefill of its blocks; each time it is answered, another
    like it is running.  B waits for MAX_REJOINS of those after the first, then goes,
    held, its prediction approximate (what it reads depends on vLLM's order)."""

    async def main() -> None:
        engine = SimEngine(SHARED[:2])
        d, kv = _dispatcher(engine, tmp_path)
        blocks = block_hashes(list(A_PROMPT), BS, "0")[: (len(A_PROMPT) - 1) // BS]
        running = d.prefills.start(R, blocks)
        routing = asyncio.create_task(d.route(_greq("b", B_PROMPT), None))
        for _ in range(MAX_REJOINS + 1):
            for _ in range(5):  # B is waiting for the one running
                await asyncio.sleep(0)
            later = d.prefills.start(R, blocks)  # routed while B waited
            d.prefills.finish(running)  # its first token: B holds again, finds ``later``
            running = later
        b = await routing
        d.release(b)
        d.prefills.finish(running)
        await kv.close()
        get = d._metrics.registry.get_sample_value
        assert get("vcache_prefill_waits_total", {"outcome": "joined"}) == MAX_REJOINS + 1
        assert not get("vcache_prefill_waits_total", {"outcome": "timeout"})  # it went at once
        assert b.approximate == "prefill_in_flight"
        assert b.predicted_cached_tokens == 2 * BS

    asyncio.run(main())


def test_a_refused_or_failed_hold_is_approximate(tmp_path: Path) -> None:
    async def main() -> None:
        small = SimEngine(SHARED, num_blocks=8)  # 25% of 8: two blocks, three asked
        d, kv = _dispatcher(small, tmp_path)
        b = await d.route(_greq("b", B_PROMPT), None)
        d.release(b)
        await kv.close()
        assert b.approximate == "hold_budget" and small.holds == {}
        assert b.predicted_cached_tokens == 3 * BS  # the index's, not held

        broken = SimEngine(SHARED, fail=True)
        d, kv = _dispatcher(broken, tmp_path / "x")
        b = await d.route(_greq("b", B_PROMPT), None)
        d.release(b)
        await kv.close()
        assert b.approximate == "hold_failed"
        assert b.headers()["x-vcache-prediction"] == "approximate"

        off = SimEngine(SHARED)
        d, kv = _dispatcher(off, tmp_path / "y", hold_share=0.0)
        b = await d.route(_greq("b", B_PROMPT), None)
        d.release(b)
        await kv.close()
        assert b.approximate == "no_hold" and off.holds == {}

    (tmp_path / "x").mkdir()
    (tmp_path / "y").mkdir()
    asyncio.run(main())


def test_the_hold_is_given_back_on_every_path_and_counted(tmp_path: Path) -> None:
    """Released once whichever path comes first (the first token, the loop's finally),
    the engine told in one batch; the blocks and time counted."""

    async def main() -> None:
        engine = SimEngine(SHARED)
        d, kv = _dispatcher(engine, tmp_path)
        m = d._metrics
        one = await d.route(_greq("one", B_PROMPT), None)
        two = await d.route(_greq("two", A_PROMPT), None)
        assert len(engine.holds) == 2 and kv.holds.held == {R: 6}
        d.release(one)
        d.release(one)  # twice is once
        d.prefills.finish(two.prefill)  # the first-token path
        d.release(two)
        assert kv.holds.held == {R: 0} and kv.holds.pending() == 2
        await kv.holds.flush()
        assert engine.holds == {} and engine.held == {}
        get = m.registry.get_sample_value
        assert get("vcache_kv_holds_total", {"replica": R, "outcome": "held"}) == 2
        assert get("vcache_kv_hold_blocks_total", {"replica": R}) == 6
        assert get("vcache_kv_hold_seconds_count") == 2
        await kv.close()

    asyncio.run(main())


def test_prediction_results_name_the_cause() -> None:
    r = Replica(R, SimEngine([]))  # type: ignore[arg-type]
    d = Dispatch(r, R, 48, ())
    assert prediction_result(d, 48) == ("exact", "")
    assert prediction_result(d, 16) == ("missed", "evicted")
    assert prediction_result(d, 64) == ("missed", "stored_since")
    a = Dispatch(r, R, 48, (), approximate="hold_budget")
    assert prediction_result(a, 16) == ("approximate", "hold_budget")
