"""The tap relays requests and streamed answers unchanged and records each exchange."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from tests.agents.tap import Tap

EVENTS = [b'event: a\ndata: {"n": 1}\n\n', b'event: b\ndata: {"n": 2}\n\n']


class _Upstream(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: list[tuple[str, bytes, str | None]] = []

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        self.seen.append((self.path, body, self.headers.get("x-api-key")))
        if self.path.startswith("/v1/bad"):
            err = b'{"error": {"message": "no"}}'
            self.send_response(400)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(err)))
            self.end_headers()
            self.wfile.write(err)
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.send_header("x-vcache-predicted-cached-tokens", "128")
        self.end_headers()
        for e in EVENTS:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(e), e))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")


@pytest.fixture
def upstream() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_streams_pass_through_and_exchanges_are_recorded(upstream: str) -> None:
    with Tap(upstream) as tap, httpx.Client(base_url=tap.url, timeout=10) as c:
        with c.stream(
            "POST", "/v1/messages?beta=true", json={"model": "m"}, headers={"x-api-key": "k"}
        ) as r:
            chunks = list(r.iter_bytes())
        bad = c.post("/v1/bad", content=b'{"model": "m"}')  # the same connection again
        xs = tap.exchanges
    assert r.status_code == 200 and b"".join(chunks) == b"".join(EVENTS)
    assert bad.status_code == 400 and bad.json() == {"error": {"message": "no"}}
    assert _Upstream.seen[-2] == ("/v1/messages?beta=true", b'{"model":"m"}', "k")
    assert [(x.method, x.path, x.status, x.ok) for x in xs] == [
        ("POST", "/v1/messages?beta=true", 200, True),
        ("POST", "/v1/bad", 400, False),
    ]
    assert xs[0].predicted() == 128 and xs[0].error is None
    assert xs[1].error == '{"error": {"message": "no"}}'
    assert xs[1].record()["model"] == "m"


def test_an_unreachable_gateway_is_a_502_recorded() -> None:
    with Tap("http://127.0.0.1:9") as tap, httpx.Client(base_url=tap.url, timeout=10) as c:
        r = c.post("/v1/responses", json={"model": "m"})
        xs = tap.exchanges
    assert r.status_code == 502
    assert len(xs) == 1 and xs[0].status == 0 and not xs[0].ok
    assert xs[0].error is not None and xs[0].error.startswith("tap: ")
