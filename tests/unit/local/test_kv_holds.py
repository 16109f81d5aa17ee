"""SpanHolds: a hold's receipt given back once, the releases batched per replica and
sent by its task, an engine that cannot hold or release never an error."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from engines.errors import EngineUnavailable
from gateway.local.kv_holds import SpanHolds
from gateway.local.kv_sync import KVSync
from gateway.local.leases import LeaseBook
from manifest.hashing import block_hashes
from manifest.index import LocationId, PrefixIndex
from tests.unit.waits import until

R0, R1 = LocationId("replica-0"), LocationId("replica-1")
HASHES = block_hashes(list(range(64)), 16, "0")


class Core:
    def __init__(self, answer: dict[str, Any] | None = None) -> None:
        self.answer = answer or {"held": 4, "refused": ""}
        self.calls: list[tuple[str, Any]] = []
        self.down = False

    async def call_core(self, method: str, *args: Any) -> Any:
        if self.down:
            raise EngineUnavailable("the core does not answer")
        self.calls.append((method, args[0]))
        if method == "vcache_hold":
            return self.answer
        if method == "vcache_release":
            return {"freed": 4 * len(args[0])}
        raise AssertionError(method)

    def generate(self, request: Any) -> Any:
        raise AssertionError("not used")


@asynccontextmanager
async def _sync(cores: dict[LocationId, Core]) -> AsyncIterator[KVSync]:
    """The index over ``cores``, closed on the way out (its event subscribers' sockets
    left to the garbage collector block the interpreter's exit)."""
    kv = KVSync(PrefixIndex(), LeaseBook())
    for r, core in cores.items():
        kv.attach(r, core, f"ipc:///tmp/never-{r}", None)
    try:
        yield kv
    finally:
        await kv.close()


def test_a_receipt_is_given_back_once_and_released_in_one_batch_per_replica() -> None:
    async def main() -> None:
        c0, c1 = Core(), Core()
        async with _sync({R0: c0, R1: c1}) as kv:
            holds = SpanHolds(kv, "gw")
            seconds: list[float] = []
            a = await holds.take(R0, HASHES, 0.25, 16, 10, lambda h, s: seconds.append(s))
            b = await holds.take(R0, HASHES, 0.25, 16, 10)
            c = await holds.take(R1, HASHES, 0.25, 16, 10)
            assert a.hold is not None and b.hold is not None and c.hold is not None
            assert (a.blocks, a.refused) == (4, "") and holds.held == {R0: 8, R1: 4}
            assert a.hold.hold_id != b.hold.hold_id
            task = asyncio.create_task(holds.run())
            a.hold.give()
            a.hold.give()  # twice is once
            b.hold.give()
            c.hold.give()
            await until(lambda: holds.pending() == 0, "released")
            await until(lambda: len(c1.calls) == 2, "replica-1 told")
            assert c0.calls[-1] == ("vcache_release", [a.hold.hold_id, b.hold.hold_id])
            assert c1.calls[-1] == ("vcache_release", [c.hold.hold_id])
            assert holds.held == {R0: 0, R1: 0} and len(seconds) == 1
            task.cancel()

    asyncio.run(main())


def test_refused_failed_and_nothing_resident_leave_no_receipt() -> None:
    async def main() -> None:
        refusing = Core({"held": 0, "refused": "budget"})
        cold = Core({"held": 0, "refused": ""})
        down = Core()
        down.down = True
        async with _sync({R0: refusing, R1: cold, LocationId("r2"): down}) as kv:
            holds = SpanHolds(kv, "gw")
            assert tuple(await holds.take(R0, HASHES, 0.25, 16, 10)) == (None, None, "budget")
            assert tuple(await holds.take(R1, HASHES, 0.25, 16, 10)) == (None, 0, "")
            assert tuple(await holds.take(LocationId("r2"), HASHES, 0.25, 16, 10)) == (
                None,
                None,
                "failed",
            )
        ok = Core()
        async with _sync({R0: ok}) as kv:
            holds = SpanHolds(kv, "gw")
            got = await holds.take(R0, HASHES, 0.25, 16, 10)
            assert got.hold is not None
            got.hold.give()
            ok.down = True  # the engine died: its holds run out there; nothing raises here
            await holds.flush()
            assert holds.pending() == 0

    asyncio.run(main())


def test_only_a_warm_prediction_costs_an_engine_round_trip(tmp_path: Path) -> None:
    """The hold's answer is the prediction, but a request the index predicts cold has no
    block to hold and no eviction can make 0 wrong: it is routed exact with no call to
    the engine.  A warm one is held (one call)."""
    from tests.unit.local.test_prediction_races import (
        A_PROMPT,
        SHARED,
        SimEngine,
        _dispatcher,
        _greq,
    )

    class Counted(SimEngine):
        calls: list[str]

        async def call_core(self, method: str, *args: Any) -> Any:
            self.calls.append(method)
            return await super().call_core(method, *args)

    async def main() -> None:
        for resident, held in (([], False), (SHARED, True)):
            engine = Counted(resident)
            engine.calls = []
            d, kv = _dispatcher(engine, tmp_path)
            x = await d.route(_greq("a", A_PROMPT), None)
            assert x.headers()["x-vcache-prediction"] == "exact"
            assert x.predicted_cached_tokens == (48 if held else 0)
            assert ("vcache_hold" in engine.calls) == held
            d.release(x)
            await kv.close()

    asyncio.run(main())
