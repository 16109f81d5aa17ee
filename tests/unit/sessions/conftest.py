"""The session log's stores: each store test runs on SQLite and on PostgreSQL."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gateway.sessions.sql import FsyncPolicy
from gateway.sessions.store import SessionStore

MakeStore = Callable[..., SessionStore]


@pytest.fixture(params=["sqlite", "postgres"])
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[MakeStore]:
    """A factory of stores over one database: a SQLite file, or a PostgreSQL database
    of this test's own.  Two stores from it are two gateways sharing one log."""
    url = request.getfixturevalue("postgres_url") if request.param == "postgres" else None
    opened: list[SessionStore] = []

    def make(fsync: FsyncPolicy = "normal") -> SessionStore:
        store = SessionStore(tmp_path / "s.db", fsync, url=url)
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()
