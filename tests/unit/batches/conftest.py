"""What the batch tests run on: batch stores over one SQLite file (``open_store``: two
stores from it are two gateways, or one before and after a restart; the stores tier
runs the same tests over PostgreSQL), and for the app tests the in-memory engine behind
the demo tokenizer, two tenants' keys, the official SDKs through ``TestClient``."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from engines.tokenizer import ChatTokenizer
from gateway.batches.store import BatchStore
from gateway.core.config import ApiKeyConfig, hash_api_key

OpenStore = Callable[..., BatchStore]

MODEL = "vcache-demo"
KEY, OTHER = "sk-batch-one", "sk-batch-two"


@pytest.fixture(scope="module")
def tokenizer(demo_model: Path) -> ChatTokenizer:
    return ChatTokenizer.from_pretrained(str(demo_model))


def keys() -> list[ApiKeyConfig]:
    return [
        ApiKeyConfig(sha256=hash_api_key(KEY), tenant="one", name="one"),
        ApiKeyConfig(sha256=hash_api_key(OTHER), tenant="two", name="two"),
    ]


@pytest.fixture
def open_store(tmp_path: Path) -> Iterator[OpenStore]:
    """Stores over one database (closed after the test)."""
    opened: list[BatchStore] = []

    def make(clock: Callable[[], float] = time.time) -> BatchStore:
        store = BatchStore(tmp_path / "batches.db", clock=clock)
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()
