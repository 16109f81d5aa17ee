"""The lifespan's shutdown runs every step: one that raises (here a replica's engine that
fails to close) is logged, and the steps after it still run, so the session log's
writer commits what it was handed and its thread ends."""

from __future__ import annotations

import logging
import sqlite3
import threading
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from engines.fake import FakeEngine
from engines.tokenizer import ChatTokenizer
from gateway.app import create_app
from tests.settings import gateway_settings


class StuckEngine(FakeEngine):
    """An engine whose close fails."""

    async def close(self) -> None:
        await super().close()
        raise RuntimeError("the engine core did not answer its shutdown")


def _writers() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "session-log" and t.is_alive()}


def test_a_failing_step_does_not_skip_closing_the_session_log(
    demo_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engine = StuckEngine(ChatTokenizer.from_pretrained(str(demo_model)), max_model_len=512)
    db = tmp_path / "sessions.db"
    settings = gateway_settings(session_log={"path": db})
    before = _writers()
    app = create_app(settings, [engine])
    with caplog.at_level(logging.ERROR, logger="gateway.app"), TestClient(app) as client:
        r = client.post(
            "/v1/chat/completions",
            json={"model": "vcache-demo", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert r.status_code == 200, r.text
        assert _writers() - before  # this app's writer runs
    assert not _writers() - before  # and ended with the lifespan
    assert any("stopping the replicas failed" in m for m in caplog.messages)
    with sqlite3.connect(db) as con:
        (events,) = con.execute("SELECT count(*) FROM events").fetchone()
    assert events >= 2  # the request and its answer, committed
