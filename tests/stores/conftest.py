"""The stores tier's own fixtures: the session log's stores on PostgreSQL (the shared
servers' fixtures, ``postgres_url`` and the rest, are in tests/conftest.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gateway.batches.store import BatchStore
from gateway.sessions.sql import FsyncPolicy
from gateway.sessions.store import SessionStore
from tests.unit.batches.conftest import OpenStore

MakeStore = Callable[..., SessionStore]


@pytest.fixture
def make_store(tmp_path: Path, postgres_url: str) -> Iterator[MakeStore]:
    """A factory of stores over one database, a PostgreSQL database of this test's own:
    two stores from it are two gateways sharing one log."""
    opened: list[SessionStore] = []

    def make(fsync: FsyncPolicy = "normal", clock: Callable[[], float] = time.time) -> SessionStore:
        store = SessionStore(tmp_path / "s.db", fsync, url=postgres_url, clock=clock)
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


@pytest.fixture
def open_store(tmp_path: Path, postgres_url: str) -> Iterator[OpenStore]:
    """The batch tests' stores (tests/unit/batches, run again here) over a PostgreSQL
    database of this test's own: the batches are tables of the session log's database,
    shared by every gateway over it; no SQLite file is made."""
    opened: list[BatchStore] = []

    def make(clock: Callable[[], float] = time.time) -> BatchStore:
        store = BatchStore(tmp_path / "unused.db", url=postgres_url, clock=clock)
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()
    assert not (tmp_path / "unused.db").exists()
