"""Shared fixtures: the demo model is built once and reused across runs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def data_dir() -> Path:
    path = Path(os.environ.get("VCACHE_TEST_DATA_DIR", REPO / ".vcache-test-data"))
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def demo_model(data_dir: Path) -> Path:
    from engines.vllm.demo_model import ensure_demo_model

    return ensure_demo_model(data_dir)


@pytest.fixture(scope="session", autouse=True)
def _gateway_state(tmp_path_factory: pytest.TempPathFactory) -> None:
    """In-process gateways keep their state (the session log) in a temporary directory and
    rebuild every request from the log before sending it (verify_reconstruction)."""
    os.environ["VCACHE_DATA_DIR"] = str(tmp_path_factory.mktemp("vcache-data"))
    os.environ["VCACHE_SESSION_LOG__VERIFY_RECONSTRUCTION"] = "true"


from tests.stores import (  # noqa: E402,F401  (shared fixtures)
    postgres_url,
    redis_prefix,
    throwaway_postgres,
    throwaway_redis,
)
