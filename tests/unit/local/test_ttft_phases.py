"""A local request's TTFT split by phase (gateway/local/ttft.py): the gateway's stamps
and the engine core's add up to the TTFT, each phase where its wait happened."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator

import pytest

from engines.base import CoreTimes, GenerateChunk, GenerateRequest, SamplingOptions
from gateway.core.metrics import Metrics
from gateway.local.dispatch import Dispatch, Dispatcher, Totals
from gateway.local.replicas import Replica
from gateway.local.routing import Router
from gateway.local.ttft import PHASES, Stamps
from manifest.index import LocationId
from tests.unit.builders import booted
from tests.unit.waits import until

R = LocationId("replica-0")
QUEUE_S = 0.05
PREFILL_S = 0.03
GATE_S = 0.15  # how long r2 is kept waiting for r1's slot


class _Engine:
    """A core that queues each request ``QUEUE_S`` and prefills it ``PREFILL_S``, then
    holds its answer until ``release`` is set."""

    ready = True

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def generate(self, greq: GenerateRequest) -> AsyncGenerator[GenerateChunk, None]:
        queued = time.monotonic()
        await asyncio.sleep(QUEUE_S)
        scheduled = time.monotonic()
        await asyncio.sleep(PREFILL_S)
        times = CoreTimes(queued, scheduled, time.monotonic())
        yield GenerateChunk("a", (1,), 8, 0, core_times=times)
        await self.release.wait()
        yield GenerateChunk("b", (2,), 8, 0, finish_reason="stop")


async def _answer(
    d: Dispatcher, rid: str, started: asyncio.Event, priority: int = 0
) -> tuple[float, Totals]:
    """The answer's TTFT and its totals; ``started`` is set at its first token."""
    greq = GenerateRequest(rid, tuple(range(8)), SamplingOptions(max_tokens=2), priority=priority)
    t0 = time.perf_counter()
    first: float | None = None
    totals = None
    async for out in d.run(greq, Dispatch(d.replicas[0], R, None), "chat", t0):
        if isinstance(out, Totals):
            totals = out
            continue
        first = first or time.perf_counter()
        started.set()
    assert first is not None and totals is not None
    return first - t0, totals


def test_phases_add_up_to_the_ttft_and_each_wait_lands_in_its_own() -> None:
    async def main() -> None:
        engine = _Engine()
        m = Metrics()
        d = Dispatcher(booted([Replica(R, engine)]), Router(), m, max_inflight=8, slots=1)  # type: ignore[arg-type]
        r1_started = asyncio.Event()
        first = asyncio.create_task(_answer(d, "r1", r1_started))
        await until(r1_started.is_set, "r1 holds the one slot, past its first token")
        second = asyncio.create_task(_answer(d, "r2", asyncio.Event(), -1))
        waits = m.registry.get_sample_value
        await until(lambda: waits("vcache_fair_queue_waits_total", {"replica": R}), "r2 waits")
        await asyncio.sleep(GATE_S)  # the wait the gate phase measures (the thing under test)
        engine.release.set()
        _, ahead = await first
        ttft, behind = await second
        assert ahead.phases is not None and behind.phases is not None
        assert set(behind.phases) == set(PHASES)
        assert all(s >= 0 for s in behind.phases.values())
        assert behind.phases["gate"] >= GATE_S  # waited for r1's slot
        assert ahead.phases["gate"] < 0.05  # a free slot
        for p in (ahead.phases, behind.phases):
            assert p["queue"] >= QUEUE_S * 0.9
            assert p["prefill"] >= PREFILL_S * 0.9
        # the stamps cover the whole of the TTFT the dispatcher observed
        assert sum(behind.phases.values()) == pytest.approx(ttft, abs=0.01)
        get = m.registry.get_sample_value
        for phase in PHASES:
            labels = {"phase": phase, "priority": "interactive"}
            assert get("vcache_ttft_phase_seconds_count", labels) == 1.0
        gate = get("vcache_ttft_phase_seconds_sum", {"phase": "gate", "priority": "interactive"})
        assert gate == pytest.approx(behind.phases["gate"])

    asyncio.run(main())


def test_no_phases_without_the_core_stamps_or_with_clocks_out_of_order() -> None:
    s = Stamps(arrived=10.0, dispatched=10.1)
    assert s.phases(CoreTimes(10.3, 10.4, 10.5), 10.6) is None  # never sent
    s.sent = 10.2
    assert s.phases(None, 10.6) is None  # a remote engine: no core stamps
    assert s.phases(CoreTimes(10.1, 10.4, 10.5), 10.6) is None  # queued before it was sent
    got = s.phases(CoreTimes(10.3, 10.4, 10.5), 10.6)
    assert got is not None
    assert list(got) == list(PHASES)
    assert [round(v, 6) for v in got.values()] == [0.1] * 6
