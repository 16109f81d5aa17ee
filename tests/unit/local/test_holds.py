"""A request's predicted cached blocks are held on its replica from routing to its first
token (``cache.hold_predicted_s``): requests that run while it waits cannot evict them."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from pathlib import Path
from typing import Any

from engines.base import GenerateChunk, GenerateRequest, SamplingOptions
from gateway.core.metrics import Metrics
from gateway.local.dispatch import Dispatch, Dispatcher, Totals
from gateway.local.replicas import Replica
from gateway.local.routing import Router
from gateway.local.spans import KVSpans
from manifest.hashing import block_hashes
from manifest.index import LocationId
from tests.unit.local.fake_core import FakeCore

R = LocationId("replica-0")
BS = 16
PROMPT = tuple(range(BS * 4 + 3))
HASHES = block_hashes(list(PROMPT), BS, "0")


class _Engine:
    """Generates after ``go`` is set; notes, in the core's call log, when it was asked
    and which blocks were pinned then."""

    ready = True

    def __init__(self, core: FakeCore) -> None:
        self.core = core
        self.go = asyncio.Event()
        self.pinned_at_start: set[bytes] = set()

    async def generate(self, greq: GenerateRequest) -> AsyncGenerator[GenerateChunk, None]:
        self.core.calls.append("generate")
        self.pinned_at_start = set(self.core.pins)
        await self.go.wait()
        yield GenerateChunk("a", (1,), len(PROMPT), 3 * BS)
        yield GenerateChunk("b", (2,), len(PROMPT), 3 * BS, finish_reason="stop")


def _metric(m: Metrics, result: str) -> float:
    return (
        m.registry.get_sample_value("vcache_kv_hold_blocks_total", {"replica": R, "result": result})
        or 0.0
    )


def _setup(tmp_path: Path, capacity: int = 10, hold_s: float | None = 30.0) -> Any:
    kv = KVSpans(BS, "0", pin_max_share=0.5, default_lease_s=60)
    core = FakeCore(HASHES[:3], capacity, num_blocks=16)
    kv.attach(R, core, f"ipc://{tmp_path}/events", None)
    kv.index.apply_stored(R, HASHES[:3])
    engine = _Engine(core)
    m = Metrics()
    d = Dispatcher([Replica(R, engine)], Router(), kv, m, max_inflight=8,  # type: ignore[arg-type]
                   hold_s=hold_s)  # fmt: skip
    d.started = True
    return kv, core, engine, d, m


Body = Callable[[KVSpans, FakeCore, _Engine, Dispatcher, Metrics], Awaitable[None]]


def _run(tmp_path: Path, body: Body, capacity: int = 10, hold_s: float | None = 30.0) -> None:
    """``body`` over a dispatcher with holds; the spans are closed whatever it asserts."""

    async def main() -> None:
        kv, core, engine, d, m = _setup(tmp_path, capacity, hold_s)
        try:
            await body(kv, core, engine, d, m)
        finally:
            await kv.close()

    asyncio.run(main())


def _dispatch(d: Dispatcher) -> Dispatch:
    return Dispatch(d.replicas[0], R, 3 * BS, HASHES)


def _greq() -> GenerateRequest:
    return GenerateRequest("req-1", PROMPT, SamplingOptions(max_tokens=2))


async def _first(d: Dispatcher, engine: _Engine) -> tuple[AsyncGenerator[GenerateChunk, None], Any]:
    run = d.run(_greq(), _dispatch(d), "chat", time.perf_counter(), Totals())
    first = asyncio.ensure_future(run.__anext__())
    await asyncio.sleep(0.01)  # the request is in the engine, waiting
    return run, first


def test_the_predicted_blocks_are_held_until_the_first_token(tmp_path: Path) -> None:
    async def body(kv: KVSpans, core: FakeCore, engine: _Engine, d: Dispatcher, m: Metrics) -> None:
        run, first = await _first(d, engine)
        assert core.calls[:2] == ["vcache_pin", "generate"]  # the pin went first
        assert engine.pinned_at_start == {bytes(h) for h in HASHES[:3]}
        assert kv.pin_owners(R, HASHES[0]) == ["hold:req-1"]
        engine.go.set()
        await first
        await d.settle()
        assert core.pins == set() and core.calls[-1] == "vcache_unpin"
        assert kv.pin_owners(R, HASHES[0]) == []
        async for _ in run:  # the rest streams; nothing more is pinned or released
            pass
        assert core.calls.count("vcache_pin") == core.calls.count("vcache_unpin") == 1
        assert _metric(m, "held") == 3

    _run(tmp_path, body)


def test_a_sessions_lease_holds_them_already_no_engine_call(tmp_path: Path) -> None:
    async def body(kv: KVSpans, core: FakeCore, engine: _Engine, d: Dispatcher, _: Metrics) -> None:
        await kv.pin(R, HASHES[:3], "session:t:s1", 60)
        core.calls.clear()
        run, first = await _first(d, engine)
        assert kv.pin_owners(R, HASHES[0]) == ["session:t:s1", "hold:req-1"]
        engine.go.set()
        await first
        await run.aclose()
        await d.settle()
        assert core.calls == ["generate"]
        assert kv.pin_owners(R, HASHES[0]) == ["session:t:s1"]
        assert core.pins == {bytes(h) for h in HASHES[:3]}

    _run(tmp_path, body)


def test_past_the_pin_budget_a_hold_is_refused_block_by_block(tmp_path: Path) -> None:
    async def body(kv: KVSpans, core: FakeCore, engine: _Engine, d: Dispatcher, m: Metrics) -> None:
        run, first = await _first(d, engine)
        assert engine.pinned_at_start == {bytes(HASHES[0])}
        engine.go.set()
        await first
        await run.aclose()
        await d.settle()
        assert (_metric(m, "held"), _metric(m, "refused")) == (1, 2)
        assert core.pins == set()

    _run(tmp_path, body, capacity=1)


def test_a_client_gone_before_the_first_token_leaves_nothing_held(tmp_path: Path) -> None:
    async def body(kv: KVSpans, core: FakeCore, engine: _Engine, d: Dispatcher, _: Metrics) -> None:
        run, first = await _first(d, engine)
        assert core.pins
        first.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await first
        await run.aclose()
        await d.settle()
        assert core.pins == set() and kv.leases.count(R) == 0

    _run(tmp_path, body)


def test_holds_off_nothing_is_pinned(tmp_path: Path) -> None:
    async def body(kv: KVSpans, core: FakeCore, engine: _Engine, d: Dispatcher, _: Metrics) -> None:
        run, first = await _first(d, engine)
        engine.go.set()
        await first
        await run.aclose()
        assert core.calls == ["generate"]

    _run(tmp_path, body, hold_s=None)


def test_the_hold_lease_ends_by_itself_when_the_wait_outlasts_it(tmp_path: Path) -> None:
    """A request that waits longer than ``hold_s`` does not keep its blocks pinned: the
    reaper ends the hold's lease like any other; the release at the first token then
    has nothing left to do."""

    async def body(kv: KVSpans, core: FakeCore, engine: _Engine, d: Dispatcher, _: Metrics) -> None:
        run, first = await _first(d, engine)
        await asyncio.sleep(0.06)
        assert await kv.reap() == 3 and core.pins == set()
        engine.go.set()
        await first
        await run.aclose()
        await d.settle()
        assert core.calls.count("vcache_unpin") == 1  # the reaper's

    _run(tmp_path, body, hold_s=0.05)
