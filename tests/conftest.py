"""Shared fixtures: the demo model is built once and reused across runs.  In-process
gateways take their settings from :func:`tests.settings.gateway_settings` (a data
directory of their own, the session log verified); no fixture changes the environment."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytest_plugins = ["tests.resource_leaks"]  # a resource left to the collector fails the run


@pytest.fixture(scope="session")
def data_dir() -> Path:
    path = Path(os.environ.get("VCACHE_TEST_DATA_DIR", REPO / ".vcache-test-data"))
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def demo_model(data_dir: Path) -> Path:
    from engines.vllm.demo_model import ensure_demo_model

    return ensure_demo_model(data_dir)


from tests.stores.servers import (  # noqa: E402,F401  (shared fixtures)
    postgres_url,
    redis_prefix,
    throwaway_postgres,
    throwaway_redis,
)
