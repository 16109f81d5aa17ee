"""The event loop's watch: the lag of a ready callback, a stall named by the loop
thread's stack, and the garbage collector's passes timed."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
import time
from collections.abc import Callable

import pytest

from gateway.core.loop_watch import LoopWatch, freeze_startup_heap
from tests.unit.waits import until


def _hold_the_loop(seconds: float) -> None:
    time.sleep(seconds)  # a synchronous call on the loop: nothing else runs meanwhile


class Lags:
    """The lags a watch measured (its thread calls :meth:`record`); the loop awaits them."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.seen: list[float] = []
        self._loop = loop
        self._new = asyncio.Event()

    def record(self, lag: float) -> None:
        self.seen.append(lag)
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
            self._loop.call_soon_threadsafe(self._new.set)

    async def until(self, cond: Callable[[list[float]], bool], timeout_s: float = 10.0) -> None:
        async with asyncio.timeout(timeout_s):
            while not cond(self.seen):
                self._new.clear()
                await self._new.wait()


def _watched_hold(seconds: float, expected: bool) -> tuple[int, list[float]]:
    """The loop held for ``seconds`` under a watch that calls 0.1 s a stall (inside
    ``expected()`` or not): the stalls it logged, and the lags it measured."""
    lags: list[float] = []

    async def main() -> int:
        got = Lags(asyncio.get_running_loop())
        watch = LoopWatch(
            asyncio.get_running_loop(), got.record, lambda g, s: None, interval_s=0.02, stall_s=0.1
        )
        watch.start()
        try:
            await got.until(lambda seen: len(seen) >= 2)  # a few quiet rounds
            with watch.expected() if expected else contextlib.nullcontext():
                _hold_the_loop(seconds)
                # the watch's sample of it comes in (the loop ran again: it measured the hold)
                await got.until(lambda seen: max(seen) >= seconds - 0.1)
        finally:
            watch.stop()
        lags.extend(got.seen)
        return watch.stalls

    return asyncio.run(main()), lags


def test_a_blocked_loop_is_measured_and_its_stack_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="gateway.core.loop_watch"):
        stalls, lags = _watched_hold(0.4, expected=False)
    assert stalls == 1
    assert max(lags) >= 0.3 and min(lags) < 0.1  # the stall, and the quiet rounds
    (record,) = [r for r in caplog.records if "has not run" in r.getMessage()]
    assert "_hold_the_loop" in record.getMessage()  # the stack names what held it


def test_garbage_collections_are_timed_by_generation() -> None:
    seen: list[tuple[int, float]] = []

    async def main() -> None:
        watch = LoopWatch(
            asyncio.get_running_loop(), lambda s: None, lambda g, s: seen.append((g, s))
        )
        watch.start()
        gc.collect()
        watch.stop()
        gc.collect()  # after stop: not seen

    gc.disable()  # no automatic pass in between: only the two above
    try:
        asyncio.run(main())
    finally:
        gc.enable()
    assert [g for g, _ in seen] == [2] and seen[0][1] >= 0


def test_young_passes_are_sampled_and_older_ones_all_timed() -> None:
    seen: list[int] = []

    async def main() -> None:
        watch = LoopWatch(
            asyncio.get_running_loop(), lambda s: None, lambda g, s: seen.append(g), young_every=4
        )
        watch.start()
        for _ in range(8):
            gc.collect(0)
        gc.collect(1)
        watch.stop()

    gc.disable()  # no automatic pass in between: only the ones above
    try:
        asyncio.run(main())
    finally:
        gc.enable()
    assert seen == [0, 0, 1]  # the 4th and the 8th young pass, and the older one


def test_the_watch_ends_with_its_loop() -> None:
    async def main() -> LoopWatch:
        got = Lags(asyncio.get_running_loop())
        watch = LoopWatch(
            asyncio.get_running_loop(), got.record, lambda g, s: None, interval_s=0.01
        )
        watch.start()
        await got.until(lambda seen: len(seen) >= 2)  # running: a few rounds measured
        return watch

    watch = asyncio.run(main())  # the loop closes without stop()
    assert watch._thread is not None
    watch._thread.join(timeout=2)
    assert not watch._thread.is_alive()
    watch.stop()


def test_a_long_collection_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        # every pass counts as long here
        watch = LoopWatch(
            asyncio.get_running_loop(), lambda s: None, lambda g, s: None, stall_s=0.0
        )
        watch.start()
        gc.collect()
        watch.stop()

    with caplog.at_level(logging.WARNING, logger="gateway.core.loop_watch"):
        asyncio.run(main())
    assert any(
        "a garbage collection of generation 2 took" in r.getMessage() for r in caplog.records
    )


def test_the_startup_heap_is_frozen_out_of_the_collectors_passes() -> None:
    kept = [[i] for i in range(1000)]  # tracked containers, alive
    try:
        frozen = freeze_startup_heap()
        # a frozen object leaves the count only when freed: by another thread that earlier
        # tests left running, between the two reads (CI saw 3 of ~3.3 million go so)
        assert 0 < gc.get_freeze_count() <= frozen and frozen >= len(kept)
        oldest = {id(o) for o in gc.get_objects(2)}  # what the next full pass walks
        assert all(gc.is_tracked(x) and id(x) not in oldest for x in kept)
    finally:
        gc.unfreeze()  # back where the other tests expect it
    assert gc.get_freeze_count() == 0


def test_an_expected_pause_is_measured_not_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="gateway.core.loop_watch"):
        stalls, lags = _watched_hold(0.3, expected=True)
    assert stalls == 0 and not caplog.records
    assert max(lags) >= 0.2  # measured all the same


def test_a_collection_under_a_lock_its_recording_needs_does_not_wait_for_it() -> None:
    """A pass runs in the thread that allocated, inside whatever lock that thread holds.
    Prometheus's multiprocess values share one lock that is not reentrant; recording the
    pass from the callback, under it, waited for ever.  The watch records it later, on
    its own thread, once the lock is free."""
    metric_lock = threading.Lock()  # as prometheus_client's values.MultiProcessValue
    took_it: list[bool] = []
    threads: list[str] = []

    def on_gc(generation: int, seconds: float) -> None:
        took_it.append(metric_lock.acquire(timeout=1))  # in the same thread: False
        if took_it[-1]:
            metric_lock.release()
        threads.append(threading.current_thread().name)

    async def main() -> None:
        watch = LoopWatch(asyncio.get_running_loop(), lambda s: None, on_gc, interval_s=0.01)
        watch.start()
        try:
            with metric_lock:  # a metric's write, which allocates, and a pass is due
                gc.collect()
            await until(lambda: threads, "the pass recorded by the watch's thread")
        finally:
            watch.stop()

    asyncio.run(main())
    assert took_it and all(took_it)
    assert threads[0] == "vcache-loop-watch"
