"""On the real engine, the session log answers 503 once and the client's retry is
answered at once.

The gateway in this process as ``vcache serve`` composes it (``build_replicas``: one
embedded CPU vLLM engine with its KV events; ``create_app``), over a SQLite session log
whose next append fails as a restarting server's does; the official OpenAI client.  The
refused request is a 503 ``session_log_unavailable`` with Retry-After 2, not sent and
not logged, and nothing it could have claimed is left (no prompt registered as a
running prefill, no admission or in-flight count).  Its retry, with the same prefix, is
logged and answered far inside the 30 s a leaked prefill registration would hold it."""

from __future__ import annotations

import sqlite3
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from gateway.app import create_app
from gateway.local.build import build_replicas
from gateway.sessions.store import SessionStore
from tests.integration.conftest import embedded_settings, wait_for

pytestmark = pytest.mark.integration

CLAIM_AGE_S = 30.0  # how long a sibling waits for a running prefill at most (the default)
PROMPT = "You answer questions about the vcache manual, section by section.\n" * 12


class FailsOnce(SessionStore):
    """A store whose next append fails, once armed, as a restarting server's does."""

    failures = 0

    def append(self, *args: Any, **kwargs: Any) -> Any:
        if self.failures:
            self.failures -= 1
            raise ConnectionError("server closed the connection unexpectedly")
        return super().append(*args, **kwargs)


@pytest.fixture
def served(data_dir: Path, tmp_path: Path) -> Iterator[tuple[TestClient, FailsOnce, Path]]:
    settings = embedded_settings(data_dir)
    db = tmp_path / "sessions.db"
    store = FailsOnce(db)
    with tempfile.TemporaryDirectory(prefix="vcache-") as runtime:  # the engine's sockets
        app = create_app(settings, build_replicas(settings, Path(runtime)), session_store=store)
        with TestClient(app) as http:
            wait_for(lambda: http.get("/readyz").status_code == 200, 300)
            yield http, store, db


def _logged(db: Path) -> int:
    with sqlite3.connect(db) as conn:
        return int(conn.execute("SELECT count(*) FROM requests").fetchone()[0])


def test_a_session_log_503_on_the_real_engine_and_the_retry_is_answered_at_once(
    served: tuple[TestClient, FailsOnce, Path],
) -> None:
    http, store, db = served
    client = openai.OpenAI(
        base_url=f"{http.base_url}/v1", api_key="none", http_client=http, max_retries=0
    )
    messages: Any = [
        {"role": "system", "content": PROMPT},
        {"role": "user", "content": "What does section one say?"},
    ]
    # the engine's first request (its first prefill is slower), another prompt, logged
    client.chat.completions.create(
        model="vcache-demo", messages=[{"role": "user", "content": "hello"}], max_tokens=2
    )
    before = _logged(db)
    d = http.app.state.service.dispatcher  # type: ignore[attr-defined]
    store.failures = 1  # the store's server restarts

    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model="vcache-demo", messages=messages, max_tokens=2)
    assert refused.value.status_code == 503
    assert refused.value.response.headers["retry-after"] == "2"
    assert refused.value.response.json()["error"]["code"] == "session_log_unavailable"
    assert store.failures == 0 and _logged(db) == before  # not logged, so not sent
    assert len(d.prefills) == 0  # no prompt registered for a sibling to wait on
    assert d.admission.inflight == 0 and [r.inflight for r in d.replicas] == [0]

    start = time.monotonic()  # the client's retry (after its Retry-After)
    raw = client.chat.completions.with_raw_response.create(
        model="vcache-demo", messages=messages, max_tokens=2
    )
    took = time.monotonic() - start
    answer = raw.parse()
    assert took < CLAIM_AGE_S / 6, took
    assert answer.choices[0].finish_reason is not None
    assert answer.usage is not None and answer.usage.prompt_tokens > 128  # a whole block
    assert raw.headers["x-vcache-session-kind"] == "new"  # the retry is in the log
    assert raw.headers["x-vcache-replica"] == "replica-0"
    assert _logged(db) == before + 1 and len(d.prefills) == 0
    print(f"\nthe retry after the 503 answered in {took:.2f} s")
