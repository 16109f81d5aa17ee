"""The session log's bench: its requests are journaled twice each, the record's wait is
read off every request, and the busy loop's own CPU is kept out of the loop's figure."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from gateway.sessions.log import SessionLog
from gateway.sessions.reconstruct import Reconstructor
from gateway.sessions.store import SessionStore
from loadtests.bench_session_log import Driver, Spinner, _arm, _no_adapter, table


def test_a_logged_arm_reads_each_requests_wait_and_journals_it_twice(tmp_path: Path) -> None:
    driver = Driver("new", concurrency=4, turns=2, engine_ms=2)
    out = asyncio.run(_arm(driver, 24, True, tmp_path, "off", 0, 0.5))
    assert out["jobs"] == 48  # the record and the answer of each request
    assert len(driver.waits) == 24 and all(w > 0 for w in driver.waits)
    assert 0 < out["wait_p50_ms"] <= out["wait_p90_ms"]
    assert out["writer_s"] > 0


def test_the_writers_cpu_is_its_own_logs_beside_another_idle_one(tmp_path: Path) -> None:
    other = SessionLog(
        SessionStore(tmp_path / "other.db"), Reconstructor(_no_adapter, lambda: None), False
    )
    try:
        driver = Driver("new", concurrency=4, turns=2, engine_ms=2)
        out = asyncio.run(_arm(driver, 24, True, tmp_path, "off", 0, 0.0))
    finally:
        other.close()
    assert out["writer_s"] > 0  # not the other log's writer thread, which did nothing


def test_an_arm_without_a_log_waits_for_nothing(tmp_path: Path) -> None:
    driver = Driver("new", concurrency=4, turns=2, engine_ms=2)
    out = asyncio.run(_arm(driver, 24, False, tmp_path, "off", 0, 0.0))
    assert driver.waits == [] and "wait_p50_ms" not in out and out["writer_s"] == 0.0


def test_the_spinner_holds_the_loop_and_stops_with_its_block() -> None:
    async def run() -> tuple[float, float, float]:
        with Spinner(0.8) as spinner:
            t0 = time.thread_time()
            await asyncio.sleep(0.1)
            spun = time.thread_time() - t0
        after = spinner.cpu_s
        await asyncio.sleep(0.05)
        return spun, after, spinner.cpu_s

    spun, after, later = asyncio.run(run())
    assert 0 < after <= spun  # its CPU is the loop thread's, counted apart
    assert later == after  # cancelled on the way out: it spins no more


def test_the_table_shows_the_busy_share_the_checkpoints_and_the_waits() -> None:
    row = {
        "shape": "new",
        "busy": 0.75,
        "requests": 10,
        "loop_us": 300.0,
        "writer_us": 900.0,
        "checkpoint_us": 7.0,
        "wall_us": 100.0,
        "jobs_per_commit": 1.2,
        "wait_p50_ms": 3.9,
        "wait_p90_ms": 7.9,
    }
    shown = "new 0.75 10 300 900 7 100 1.2 3.90 7.90".split()
    assert table([row]).splitlines()[-1].split() == shown
