"""One thread writes the session log, committing several requests' appends at once.

Each request hands the writer a job (place the request in its session, append
its events, update the folded state) and awaits it.  The writer runs jobs in
arrival order; the jobs waiting when it picks one up run in the same
transaction, each inside a savepoint, and the transaction commits once for all
of them (a group commit).  A job found waiting alone (most of them, under
ordinary load) needs no savepoint: its transaction is its own, and rolling
it back is rolling back the job.  A job's caller resumes only after that commit: an
acknowledged request is in the log, as durable as the ``fsync`` setting makes
a commit.  Jobs that need a transaction of their own (retention) run alone.
Being the only writer, the thread also orders the appends of one session.

Results go back to each caller's own event loop, one ``call_soon_threadsafe``
per loop per batch.  A caller that stopped waiting (its request was cancelled:
the client went away) is simply not answered; its job still runs, in order,
so the log holds whatever was handed over.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from gateway.core.errors import APIError
from gateway.sessions.store import SessionStore

log = logging.getLogger(__name__)
T = TypeVar("T")
_ATTEMPTS = 3


@dataclass
class _Job:
    fn: Callable[[], Any]
    alone: bool
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future[Any]


JobResult = tuple[Any, BaseException | None]


class _JobFailed(Exception):
    """A job's own failure, told apart from its transaction's (the commit)."""

    def __init__(self, exc: Exception) -> None:
        super().__init__(exc)
        self.exc = exc


def _deliver(results: list[tuple[asyncio.Future[Any], JobResult]]) -> None:
    """On the callers' loop: answer every caller still waiting."""
    for fut, (value, exc) in results:
        if fut.done():  # cancelled: nobody waits for it any more
            if exc is not None:
                log.warning("session log: an append failed after its caller left: %r", exc)
            continue
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(value)


class Writer:
    def __init__(
        self,
        store: SessionStore,
        on_abort: Callable[[], None] = lambda: None,
        max_batch: int = 64,
    ) -> None:
        self._store = store
        self._on_abort = on_abort  # a failed commit: forget what the jobs cached in memory
        self._max_batch = max_batch
        self._q: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="session-log", daemon=True)
        self._thread.start()
        self.commits = 0
        self.jobs = 0
        # when the store began failing every write (None: the last one succeeded); the
        # readiness probe reads it
        self.failing_since: float | None = None

    async def run(self, fn: Callable[[], T], alone: bool = False) -> T:
        """Run ``fn`` on the writer thread; return once its writes are committed."""
        loop = asyncio.get_running_loop()
        job = _Job(fn, alone, loop, loop.create_future())
        self._q.put(job)
        result: T = await job.done
        return result

    def close(self) -> None:
        """Finish the jobs already handed over, then stop."""
        self._q.put(None)
        self._thread.join()

    def _loop(self) -> None:
        pending: deque[_Job | None] = deque()
        while True:
            job = pending.popleft() if pending else self._q.get()
            if job is None:
                return
            if job.alone:
                self._settle([job], self._alone(job))
                continue
            batch = [job]
            while len(batch) < self._max_batch:
                try:
                    nxt = pending.popleft() if pending else self._q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None or nxt.alone:
                    pending.appendleft(nxt)
                    break
                batch.append(nxt)
            self._settle(batch, self._together(batch))

    def _alone(self, job: _Job) -> list[JobResult]:
        try:
            return [(job.fn(), None)]
        except Exception as exc:
            return [(None, exc)]

    def _together(self, batch: list[_Job]) -> list[JobResult]:
        out: list[JobResult] = []
        try:
            if len(batch) == 1:
                out = [self._single(batch[0])]
            else:
                with self._store.batch() as item:
                    out = [self._attempt(job, item) for job in batch]
        except Exception as exc:  # the commit failed: nothing of the batch is in the log
            log.exception("session log: a group commit of %d requests failed", len(batch))
            self._on_abort()
            if self.failing_since is None:
                self.failing_since = time.monotonic()
            return [(None, exc) for _ in batch]
        self.commits += 1
        if any(exc is None for _, exc in out):
            self.failing_since = None
        elif any(not isinstance(exc, APIError) for _, exc in out) and self.failing_since is None:
            self.failing_since = time.monotonic()  # every job failed on the store itself
        return out

    def _attempt(
        self, job: _Job, item: Callable[[], contextlib.AbstractContextManager[None]]
    ) -> JobResult:
        """One job in its savepoint; again when it lost a race with another process's
        transaction (a shared log: a deadlock, a lock timeout), which rolled back its
        writes only."""
        for attempt in range(1, _ATTEMPTS + 1):
            try:
                with item():
                    return (job.fn(), None)
            except Exception as exc:
                if attempt == _ATTEMPTS or not self._store.retryable(exc):
                    return (None, exc)
                log.info("session log: job retried after %r", exc)
        raise AssertionError("unreachable")

    def _single(self, job: _Job) -> JobResult:
        """One job in a transaction of its own, no savepoint (two statements fewer): its
        failure rolls the transaction back, which is its writes only; again when it lost
        a race with another process's transaction.  A failed commit raises."""
        for attempt in range(1, _ATTEMPTS + 1):
            try:
                with self._store.batch():
                    try:
                        value = job.fn()
                    except Exception as exc:
                        raise _JobFailed(exc) from exc
                return (value, None)
            except _JobFailed as failed:
                if attempt == _ATTEMPTS or not self._store.retryable(failed.exc):
                    return (None, failed.exc)
                log.info("session log: job retried after %r", failed.exc)
        raise AssertionError("unreachable")

    def _settle(self, batch: list[_Job], results: list[JobResult]) -> None:
        self.jobs += len(batch)
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Any], JobResult]]] = {}
        for job, outcome in zip(batch, results, strict=True):
            by_loop.setdefault(job.loop, []).append((job.done, outcome))
        for loop, answers in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, answers)
            except RuntimeError:  # that loop is closed: its callers are gone
                log.debug("session log: %d results for a closed event loop", len(answers))
