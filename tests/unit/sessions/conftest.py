"""The session log's stores in the hermetic tier: SQLite files.  The same store tests
run on PostgreSQL in the stores tier (tests/stores/test_session_log_postgres.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gateway.sessions.sql import FsyncPolicy
from gateway.sessions.store import SessionStore

MakeStore = Callable[..., SessionStore]


@pytest.fixture
def make_store(tmp_path: Path) -> Iterator[MakeStore]:
    """A factory of stores over one database, a SQLite file: two stores from it are two
    gateways sharing one log."""
    opened: list[SessionStore] = []

    def make(fsync: FsyncPolicy = "normal", clock: Callable[[], float] = time.time) -> SessionStore:
        store = SessionStore(tmp_path / "s.db", fsync, clock=clock)
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()
