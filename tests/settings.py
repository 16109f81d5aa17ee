"""Settings of the gateways the tests run in-process.

Each gets a data directory of its own (removed when the test run ends), so no
test reads what another left there or writes under the user's cache, and
rebuilds every request from the session log before sending it
(``session_log.verify_reconstruction``), unless the test says otherwise.
Nothing here touches the process environment.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path
from typing import Any

from gateway.core.config import SessionLogSettings, Settings


def _data_dir() -> Path:
    path = Path(tempfile.mkdtemp(prefix="vcache-test-data-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def gateway_settings(**values: Any) -> Settings:
    """``Settings(**values)`` with a fresh ``data_dir``, the log verified and no gRPC
    server (a test that wants one passes ``grpc_port=0``: a free port; the default
    50051 may be another process's), where not given."""
    values.setdefault("grpc_port", None)
    if "data_dir" not in values:
        values["data_dir"] = _data_dir()
    log = values.get("session_log") or {}
    if isinstance(log, SessionLogSettings):
        log = log.model_dump(exclude_unset=True)
    values["session_log"] = {"verify_reconstruction": True, **log}
    return Settings(**values)
