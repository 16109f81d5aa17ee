"""A request's predicted cached blocks are touched on its replica before it runs
(``cache.refresh_predicted``): made the last the engine evicts, so requests that run
while it waits take other blocks first."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from pathlib import Path

from engines.base import GenerateChunk, GenerateRequest, RequestHold, SamplingOptions
from gateway.core.metrics import Metrics
from gateway.local.dispatch import Dispatch, Dispatcher
from gateway.local.replicas import Replica
from gateway.local.routing import Router
from gateway.local.spans import KVSpans
from manifest.hashing import block_hashes
from manifest.index import LocationId
from tests.unit.builders import booted
from tests.unit.local.fake_core import FakeCore
from tests.unit.waits import until

R = LocationId("replica-0")
BS = 16
PROMPT = tuple(range(BS * 4 + 3))
HASHES = block_hashes(list(PROMPT), BS, "0")


class _Engine:
    """Answers when ``go`` is set; notes in the core's call log when it was asked."""

    ready = True

    def __init__(self, core: FakeCore) -> None:
        self.core = core
        self.go = asyncio.Event()
        self.go.set()

    async def generate(self, greq: GenerateRequest) -> AsyncGenerator[GenerateChunk, None]:
        self.core.calls.append(f"generate {greq.request_id}")
        await self.go.wait()
        yield GenerateChunk("a", (1,), len(PROMPT), 3 * BS, finish_reason="stop")


Body = Callable[[FakeCore, _Engine, Dispatcher, Metrics], Awaitable[None]]


def _run(tmp_path: Path, body: Body, refresh: bool = True, slots: int | None = None) -> None:
    async def main() -> None:
        kv = KVSpans(BS, "0", pin_max_share=0.5, default_lease_s=60)
        core = FakeCore(HASHES[:3], 10, num_blocks=16)
        kv.attach(R, core, f"ipc://{tmp_path}/events", None)
        engine = _Engine(core)
        m = Metrics()
        replicas = booted([Replica(R, engine)], kv)  # type: ignore[arg-type]
        d = Dispatcher(replicas, Router(), m, max_inflight=8, slots=slots, refresh=refresh)
        try:
            await body(core, engine, d, m)
        finally:
            await d.settle()
            await kv.close()

    asyncio.run(main())


async def _answer(
    d: Dispatcher, rid: str, predicted: int | None = 3 * BS, carried: bool = False
) -> None:
    greq = GenerateRequest(rid, PROMPT, SamplingOptions(max_tokens=1))
    hold = RequestHold(tuple(bytes(h) for h in HASHES), 0.25, 1, 10.0) if carried else None
    dispatch = Dispatch(d.replicas[0], R, predicted, HASHES, carried=hold)
    async for _ in d.run(greq, dispatch, "chat", time.perf_counter()):
        pass


def _touched(m: Metrics, result: str = "touched") -> float:
    labels = {"replica": R, "result": result}
    return m.registry.get_sample_value("vcache_kv_refreshed_blocks_total", labels) or 0.0


def test_the_predicted_blocks_are_touched_before_the_request_goes(tmp_path: Path) -> None:
    async def body(core: FakeCore, engine: _Engine, d: Dispatcher, m: Metrics) -> None:
        await _answer(d, "r1")
        await d.settle()
        assert core.calls == ["vcache_touch", "generate r1"]  # the touch went first
        assert core.touched == [[bytes(h) for h in HASHES[:3]]]
        assert _touched(m) == 3

    _run(tmp_path, body)


def test_a_request_that_waited_for_a_slot_is_touched_again(tmp_path: Path) -> None:
    async def body(core: FakeCore, engine: _Engine, d: Dispatcher, m: Metrics) -> None:
        engine.go.clear()
        first = asyncio.create_task(_answer(d, "r1"))
        await until(lambda: "generate r1" in core.calls, "r1 has the only slot")
        second = asyncio.create_task(_answer(d, "r2"))
        waits = m.registry.get_sample_value
        await until(lambda: waits("vcache_fair_queue_waits_total", {"replica": R}), "r2 waits")
        engine.go.set()
        await asyncio.gather(first, second)
        await d.settle()
        assert core.calls == [
            "vcache_touch",
            "generate r1",
            "vcache_touch",
            "vcache_touch",
            "generate r2",
        ]
        assert _touched(m) == 9

    _run(tmp_path, body, slots=1)


def test_a_request_carrying_its_hold_is_touched_only_if_it_may_wait(tmp_path: Path) -> None:
    """Its hold, taken as the core queues it, keeps the blocks: no touch beside it.  One
    that finds its slot taken is touched before it waits, and again after."""

    async def free(core: FakeCore, engine: _Engine, d: Dispatcher, m: Metrics) -> None:
        await _answer(d, "r1", carried=True)
        await d.settle()
        assert core.calls == ["generate r1"] and _touched(m) == 0

    async def busy(core: FakeCore, engine: _Engine, d: Dispatcher, m: Metrics) -> None:
        engine.go.clear()
        first = asyncio.create_task(_answer(d, "r1", carried=True))
        await until(lambda: "generate r1" in core.calls, "r1 has the only slot")
        second = asyncio.create_task(_answer(d, "r2", carried=True))
        waits = m.registry.get_sample_value
        await until(lambda: waits("vcache_fair_queue_waits_total", {"replica": R}), "r2 waits")
        engine.go.set()
        await asyncio.gather(first, second)
        await d.settle()
        assert core.calls == ["generate r1", "vcache_touch", "vcache_touch", "generate r2"]

    _run(tmp_path, free, slots=1)
    _run(tmp_path, busy, slots=1)


def test_nothing_is_touched_when_off_or_nothing_is_predicted(tmp_path: Path) -> None:
    async def off(core: FakeCore, engine: _Engine, d: Dispatcher, m: Metrics) -> None:
        await _answer(d, "r1")
        assert core.calls == ["generate r1"]

    async def cold(core: FakeCore, engine: _Engine, d: Dispatcher, m: Metrics) -> None:
        await _answer(d, "r1", predicted=0)
        await _answer(d, "r2", predicted=None)  # the replica's hashes are not known exact
        assert core.calls == ["generate r1", "generate r2"]

    _run(tmp_path, off, refresh=False)
    _run(tmp_path, cold)


def test_blocks_evicted_before_the_touch_came_are_counted_missing(tmp_path: Path) -> None:
    async def body(core: FakeCore, engine: _Engine, d: Dispatcher, m: Metrics) -> None:
        core.resident.discard(bytes(HASHES[2]))  # gone since the index's last event
        await _answer(d, "r1")
        await d.settle()
        assert (_touched(m), _touched(m, "missing")) == (2, 1)

    _run(tmp_path, body)
