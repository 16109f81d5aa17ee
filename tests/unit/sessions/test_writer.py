"""The session log's writer: group commits, isolation of a failing job, durability."""

from __future__ import annotations

import asyncio
import functools
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from gateway.sessions.store import SessionStore
from gateway.sessions.writer import Writer
from manifest.sessionlog import MessageEvent


class Gate(threading.Event):
    """Set by the test to let the writer's first job end; ``running``: it has begun."""

    def __init__(self) -> None:
        super().__init__()
        self.running = threading.Event()


def held(gate: Gate) -> Callable[[], bool]:
    """A job that holds the writer (the others queue up behind it) until ``gate``."""

    def job() -> bool:
        gate.running.set()
        return gate.wait(5)

    return job


async def handed_over() -> None:
    """The tasks created before this call take their first step: ``Writer.run`` puts
    its job on the queue there (one turn of the loop: they were scheduled first)."""
    await asyncio.sleep(0)


def test_concurrent_appends_share_commits_and_are_on_disk_when_acknowledged(
    make_store: Callable[..., SessionStore],
) -> None:
    store = make_store("full")
    writer = Writer(store)
    gate = Gate()

    async def main() -> list[list[int]]:
        first = asyncio.ensure_future(writer.run(held(gate)))
        await asyncio.to_thread(gate.running.wait, 5)

        def job(i: int) -> list[int]:
            sid = store.create("t", f"s{i}")
            return store.append(sid, [MessageEvent("user", f"m{i}")])

        rest = [asyncio.ensure_future(writer.run(functools.partial(job, i))) for i in range(20)]
        await handed_over()
        gate.set()
        await first
        out = await asyncio.gather(*rest)
        # acknowledged: another connection sees every row already
        other = make_store()
        assert other._sql.execute("SELECT COUNT(*) FROM events").fetchone()[0] == 20
        return out

    assert asyncio.run(main()) == [[0]] * 20
    assert writer.jobs == 21 and writer.commits <= 3  # 20 appends, one or two commits
    writer.close()


def test_a_failing_job_rolls_back_only_its_own_writes(
    make_store: Callable[..., SessionStore],
) -> None:
    store = make_store()
    writer = Writer(store)
    gate = Gate()

    def bad() -> None:
        sid = store.create("t", "bad")
        store.append(sid, [MessageEvent("user", "half")])
        raise RuntimeError("boom")

    async def main() -> None:
        hold = asyncio.ensure_future(writer.run(held(gate)))
        await asyncio.to_thread(gate.running.wait, 5)
        ok = asyncio.ensure_future(
            writer.run(lambda: store.append(store.create("t", "ok"), [MessageEvent("user", "x")]))
        )
        failing = asyncio.ensure_future(writer.run(bad))
        await handed_over()
        gate.set()
        await hold
        assert await ok == [0]
        with pytest.raises(RuntimeError, match="boom"):
            await failing

    asyncio.run(main())
    assert [s.id for s in store.sessions()] == ["ok"]
    assert store.events("ok")[0][1] == MessageEvent("user", "x")
    writer.close()


def test_a_caller_that_stops_waiting_does_not_stop_the_writer(tmp_path: Path) -> None:
    """A request cancelled while its append is queued (the client went away): the append
    still lands, in order, and the writer goes on serving everyone else."""
    store = SessionStore(tmp_path / "log.db")
    writer = Writer(store)
    gate = Gate()

    def append(name: str) -> list[int]:
        return store.append(store.create("t", name), [MessageEvent("user", name)])

    async def main() -> list[int]:
        hold = asyncio.ensure_future(writer.run(held(gate)))
        await asyncio.to_thread(gate.running.wait, 5)
        gone = asyncio.ensure_future(writer.run(functools.partial(append, "gone")))
        await handed_over()
        gone.cancel()  # its caller stops waiting before the job runs
        await handed_over()
        gate.set()
        await hold
        with pytest.raises(asyncio.CancelledError):
            await gone
        return await asyncio.wait_for(writer.run(functools.partial(append, "next")), 5)

    assert asyncio.run(main()) == [0]
    assert sorted(s.id for s in store.sessions()) == ["gone", "next"]
    assert writer.jobs == 3
    writer.close()
    store.close()


def test_a_failure_nobody_waits_for_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = SessionStore(tmp_path / "log.db")
    writer = Writer(store)
    gate = Gate()

    def boom() -> None:
        raise RuntimeError("disk full")

    async def main() -> None:
        hold = asyncio.ensure_future(writer.run(held(gate)))
        await asyncio.to_thread(gate.running.wait, 5)
        gone = asyncio.ensure_future(writer.run(boom))
        await handed_over()
        gone.cancel()
        await handed_over()
        gate.set()
        await hold
        assert await asyncio.wait_for(writer.run(lambda: 7), 5) == 7

    with caplog.at_level("WARNING", logger="gateway.sessions.writer"):
        asyncio.run(main())
    assert [r.getMessage() for r in caplog.records] == [
        "session log: an append failed after its caller left: RuntimeError('disk full')"
    ]
    writer.close()
    store.close()


def test_a_job_alone_that_fails_leaves_nothing_of_its_writes(
    make_store: Callable[..., SessionStore],
) -> None:
    """A job found waiting alone runs in a transaction of its own, without a savepoint:
    its failure rolls that transaction back, which is its writes and nothing else."""
    store = make_store()
    writer = Writer(store)

    def bad() -> None:
        store.append(store.create("t", "bad"), [MessageEvent("user", "half")])
        raise RuntimeError("boom")

    async def main() -> list[int]:
        with pytest.raises(RuntimeError, match="boom"):
            await writer.run(bad)
        return await writer.run(
            lambda: store.append(store.create("t", "ok"), [MessageEvent("user", "x")])
        )

    assert asyncio.run(main()) == [0]
    assert [s.id for s in store.sessions()] == ["ok"]
    assert store.events("ok") == [(0, MessageEvent("user", "x"))]
    assert writer.failing_since is None
    writer.close()


def test_a_job_alone_that_lost_a_race_runs_again_from_a_clean_transaction(
    make_store: Callable[..., SessionStore],
) -> None:
    """Another process held the database (SQLite's "locked"): the job's first writes are
    rolled back with its transaction and the job runs again, once in the log."""
    store = make_store()
    writer = Writer(store)
    tries: list[int] = []

    def racing() -> int:
        tries.append(len(tries) + 1)
        store.append(store.create("t", "raced"), [MessageEvent("user", f"try {tries[-1]}")])
        if len(tries) == 1:
            raise sqlite3.OperationalError("database is locked")
        return tries[-1]

    assert asyncio.run(writer.run(racing)) == 2
    assert store.events("raced") == [(0, MessageEvent("user", "try 2"))]
    writer.close()
