"""A gateway under load while its PostgreSQL session log restarts: during the restart a
request gets a 503 ``session_log_unavailable`` with Retry-After (it was not sent: it is
not in the log), never another error; after it every request is served again; every
acknowledged request is in the log; readiness says degraded, then ready."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from fastapi.testclient import TestClient

from engines.fake import FakeEngine
from engines.tokenizer import ChatTokenizer
from gateway.app import create_app
from tests.settings import gateway_settings
from tests.stores.servers import ThrowawayPostgres

pytestmark = pytest.mark.stores


@pytest.fixture
def gateway(
    throwaway_postgres: ThrowawayPostgres, demo_model: Path
) -> Iterator[tuple[TestClient, ThrowawayPostgres]]:
    settings = gateway_settings(
        grpc_port=None,
        session_log={"url": throwaway_postgres.url, "unavailable_grace_s": 60},
    )
    tokenizer = ChatTokenizer.from_pretrained(str(demo_model))
    engine = FakeEngine(tokenizer, block_size=16, max_model_len=512)
    with TestClient(create_app(settings, [engine])) as http:
        yield http, throwaway_postgres


def test_a_postgres_restart_under_load_loses_nothing_acknowledged(
    gateway: tuple[TestClient, ThrowawayPostgres],
) -> None:
    http, server = gateway
    stop = threading.Event()
    outcomes: list[tuple[float, int, str, dict[str, Any]]] = []  # (when, status, id, body)
    lock = threading.Lock()

    def user(n: int) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            body = {
                "model": "vcache-demo",
                "max_tokens": 2,
                "messages": [{"role": "user", "content": f"user {n} asks {i}"}],
            }
            r = http.post("/v1/chat/completions", json=body)
            data = r.json()
            data["retry-after"] = r.headers.get("retry-after")
            with lock:
                outcomes.append((time.monotonic(), r.status_code, data.get("id", ""), data))

    def guarded(n: int) -> None:
        try:
            user(n)
        except BaseException as exc:  # a user that died is a failure of the test
            failures.append(exc)

    failures: list[BaseException] = []
    users = [threading.Thread(target=guarded, args=(n,)) for n in range(4)]
    for u in users:
        u.start()
    time.sleep(1.0)
    down_at = time.monotonic()
    server.stop("fast")
    time.sleep(1.5)
    ready = http.get("/readyz").json()
    server.start()
    up_at = time.monotonic()
    time.sleep(2.0)
    stop.set()
    for u in users:
        u.join(30)

    assert failures == []
    assert ready["status"] == "degraded" and ready["stores"]["session_log"] == "degraded"
    statuses = {s for _, s, _, _ in outcomes}
    assert statuses <= {200, 503}, statuses
    refused = [(t, b) for t, s, _, b in outcomes if s == 503]
    assert refused, "the restart window saw no request"
    assert all(b["error"]["code"] == "session_log_unavailable" for _, b in refused)
    assert all(b["retry-after"] == "2" for _, b in refused)
    assert all(down_at - 0.5 <= t <= up_at + 2.0 for t, _ in refused)  # only in the window
    after = [s for t, s, _, _ in outcomes if t > up_at + 2.0]
    served_after = [s for t, s, _, _ in outcomes if t > up_at]
    assert 200 in served_after and all(s == 200 for s in after)
    acked = [rid for _, s, rid, _ in outcomes if s == 200]
    with psycopg.connect(server.url) as db:
        logged = {r[0] for r in db.execute("SELECT request_id FROM requests").fetchall()}
    assert [rid for rid in acked if rid not in logged] == []
    assert http.get("/readyz").json()["status"] == "ready"
    print(f"\n{len(acked)} acknowledged, {len(refused)} refused during the restart")
