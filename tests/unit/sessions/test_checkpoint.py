"""The SQLite session log's WAL checkpoints run on their own thread, not in the
writer's commits."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

from gateway.sessions.checkpoint import SAFETY_PAGES, Checkpointer
from gateway.sessions.sql import SQLiteDialect

ROW = b"x" * 3000  # about a page each


def _wal_db(path: Path, autocheckpoint: int) -> sqlite3.Connection:
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute(f"PRAGMA wal_autocheckpoint={autocheckpoint}")
    db.execute("CREATE TABLE IF NOT EXISTS t(i INTEGER PRIMARY KEY, data BLOB)")
    return db


def _write(db: sqlite3.Connection, rows: range) -> None:
    for i in rows:
        db.execute("INSERT INTO t VALUES (?, ?)", (i, ROW))


def _checkpointers() -> int:
    return sum(t.name == "session-log-checkpoint" for t in threading.enumerate())


def test_a_checkpoint_copies_what_the_writer_appended(tmp_path: Path) -> None:
    db = _wal_db(tmp_path / "a.db", 0)  # the writer never checkpoints itself
    cp = Checkpointer(tmp_path / "a.db", "NORMAL", interval_s=3600)
    try:
        _write(db, range(50))
        got = cp.run()
        assert got is not None
        busy, pages, copied = got
        assert busy == 0
        assert pages >= 50  # a page a row at least, each commit its own frames
        assert copied == pages
        _write(db, range(50, 60))  # the WAL starts over after a whole checkpoint
        again = cp.run()
        assert again is not None and 0 < again[1] < pages
        assert db.execute("SELECT COUNT(*) FROM t").fetchone()[0] == 60
    finally:
        cp.close()
        db.close()


def test_the_thread_checkpoints_every_interval_and_stops_on_close(tmp_path: Path) -> None:
    db = _wal_db(tmp_path / "b.db", 0)
    before = _checkpointers()
    cp = Checkpointer(tmp_path / "b.db", "NORMAL", interval_s=0.02)
    try:
        assert _checkpointers() == before + 1
        _write(db, range(20))
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            last = cp.last
            if last is not None and last[1] >= 20 and last[2] == last[1]:
                break
            time.sleep(0.01)
        else:
            raise AssertionError(f"no whole checkpoint of 20 commits in 5 s: {cp.last}")
    finally:
        cp.close()
        db.close()
    assert _checkpointers() == before


def test_the_dialect_leaves_checkpoints_to_its_thread(tmp_path: Path) -> None:
    """The writer's connection no longer checkpoints at SQLite's 1,000 pages: past them
    the WAL still holds every page, until the checkpointer copies it."""
    dialect = SQLiteDialect(tmp_path / "c.db", "normal", checkpoint_interval_s=3600)
    try:
        auto = dialect.execute("PRAGMA wal_autocheckpoint").fetchone()[0]
        assert auto == SAFETY_PAGES
        dialect.execute("CREATE TABLE t(i INTEGER PRIMARY KEY, data BLOB)")
        for i in range(1_200):
            dialect.execute("INSERT INTO t VALUES (?, ?)", (i, ROW))
        got = dialect.checkpointer.run()
        assert got is not None
        busy, pages, copied = got
        assert busy == 0 and pages >= 1_200 and copied == pages
    finally:
        dialect.close()
    assert not (tmp_path / "c.db-wal").exists()  # the last connection closed it
