"""How long the gateway's event loop keeps ready work waiting, and what held it.

Every request's work in the gateway (tokenizing, the plan, the session log,
each streamed token) runs on one event loop.  A callback that runs long (a
synchronous write, a CPU-bound step, a garbage collection over a large heap)
delays every request in flight at once; the TTFT phases show it only as a
longer ``prepare`` or ``return`` on many requests at the same moment.

:class:`LoopWatch` measures it from a thread of its own: every ``interval_s``
it schedules a no-op on the loop and times how long the no-op waits to run
(``vcache_event_loop_lag_seconds``).  When the loop has not run it within
``stall_s``, the thread reads the loop thread's Python stack
(``sys._current_frames``) and logs it once for that stall, with whether a
garbage collection was running, so a stall has a name in the log.  The
collector's own passes are timed as well (``gc.callbacks``:
``vcache_gc_pause_seconds{generation}``): every pass of the older generations,
and one in ``young_every`` of generation 0 (a young pass walks only what was
allocated since the last, and runs every few hundred allocations: under a
streamed load, about one per output token; timing each cost ~1 µs in the
callback and a histogram observation on the watch thread, for passes of
microseconds).  The cost is one no-op on the loop per interval, a thread that
sleeps in between, and the callback's test of the generation.

A collection runs in whichever thread allocated when it was due, at any
point of that thread's code, including inside a lock it holds.  Prometheus's
multiprocess values (``--workers``) share one lock that is not reentrant: a
pass that began under it, recording its own time into a histogram, waited on
that lock for ever (a worker hung while vLLM built its metrics).  So the
callback only notes the pass; the watch thread records and logs it.

Once the replicas are up, :func:`freeze_startup_heap` moves everything
allocated so far (the modules of torch, transformers and vLLM, the tokenizer,
the settings) out of the collector's sight, as vLLM's own API server does
after its start: an oldest-generation pass then walks what serving
allocated, not the whole startup heap, and pauses the loop for that much less.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect every generation, then freeze what survives (``gc.freeze``): the
    collector skips it from now on.  Returns the objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class LoopWatch:
    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        on_lag: Callable[[float], None],
        on_gc: Callable[[int, float], None],
        interval_s: float = 0.1,
        stall_s: float = 0.25,
        young_every: int = 64,
    ) -> None:
        """``young_every``: one generation-0 pass in this many is timed (1: each)."""
        self.loop = loop
        self.on_lag = on_lag  # seconds a ready callback waited
        self.on_gc = on_gc  # (generation, seconds) of each collection
        self.interval_s = interval_s
        self.stall_s = stall_s
        self.young_every = max(1, young_every)
        self._young = 0  # generation-0 passes seen since the last timed one
        self.stalls = 0  # stalls logged
        self._loop_thread = threading.get_ident()  # started from the loop's own thread
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._gc_started: dict[int, float] = {}  # by thread: when its collection began
        self._gc_generation: int | None = None  # of the collection running now
        self._quiet = 0  # > 0: a pause is expected (measured, not logged)
        # the passes noted by the gc callback, for the watch thread: (generation, seconds,
        # objects freed, expected); a deque's append and popleft need no lock, and with the
        # loop closed (no thread to read them) the oldest fall off
        self._passes: collections.deque[tuple[int, float, int, bool]] = collections.deque(
            maxlen=1024
        )

    def start(self) -> None:
        gc.callbacks.append(self._gc)
        self._thread = threading.Thread(target=self._run, name="vcache-loop-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._gc in gc.callbacks:
            gc.callbacks.remove(self._gc)
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._record_passes()

    @contextlib.contextmanager
    def expected(self) -> Iterator[None]:
        """A pause the caller means (the startup heap's freeze): measured, not logged."""
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1

    def _gc(self, phase: str, info: dict[str, Any]) -> None:
        """The collector's callback, in the collecting thread: note the pass, nothing
        more (no metric, no log: their locks may be held by this very thread)."""
        generation = info["generation"]
        if phase == "start":
            if generation == 0:  # sampled: the cheap test first, on every young pass
                self._young += 1
                if self._young < self.young_every:
                    return
                self._young = 0
            self._gc_started[threading.get_ident()] = time.perf_counter()
            self._gc_generation = int(generation)
            return
        if generation == 0 and self._young:
            return  # a young pass not timed (passes never overlap: the collector's lock)
        self._gc_generation = None
        began = self._gc_started.pop(threading.get_ident(), None)
        if began is not None:
            took, freed = time.perf_counter() - began, int(info.get("collected", 0))
            self._passes.append((int(info["generation"]), took, freed, self._quiet > 0))

    def _record_passes(self) -> None:
        """The passes noted since the last call, into ``on_gc``; a long one is logged."""
        while True:
            try:
                generation, took, freed, expected = self._passes.popleft()
            except IndexError:  # none left (stop() and the thread may both ask)
                return
            self.on_gc(generation, took)
            if took >= self.stall_s and not expected:  # on any thread: the loop waited
                log.warning(
                    "a garbage collection of generation %d took %.0f ms (%d objects freed)",
                    generation,
                    took * 1000,
                    freed,
                )

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._record_passes()
            t0 = time.perf_counter()
            ran = threading.Event()
            try:
                self.loop.call_soon_threadsafe(ran.set)
            except RuntimeError:  # the loop is closed
                return
            if not ran.wait(self.stall_s):
                if not self._quiet:
                    self._log_stall()
                while not ran.wait(0.5):
                    self._record_passes()
                    if self._stop.is_set() or self.loop.is_closed():
                        return
            self.on_lag(time.perf_counter() - t0)

    def _log_stall(self) -> None:
        """The loop thread's stack now, while it holds the loop."""
        self.stalls += 1
        frame = sys._current_frames().get(self._loop_thread)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(no frame)\n"
        generation = self._gc_generation
        collecting = (
            f"; a garbage collection of generation {generation} is running"
            if (generation is not None)
            else ""
        )
        log.warning(
            "the event loop has not run ready work for %.0f ms%s; its thread is in:\n%s",
            self.stall_s * 1000,
            collecting,
            stack.rstrip(),
        )
