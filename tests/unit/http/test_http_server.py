"""The HTTP server's limits, over raw sockets against a real uvicorn on loopback:
oversized heads (431), slow heads (408), slow bodies (408), the requests one kept-alive
connection serves, and normal traffic untouched."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn

from engines.fake import FakeEngine
from engines.tokenizer import ChatTokenizer
from gateway.app import create_app
from gateway.http.server import guarded_protocol
from tests.settings import gateway_settings

TIMEOUT_S = 0.5
PER_CONNECTION = 4  # requests a kept-alive connection serves


@pytest.fixture(scope="module")
def server(demo_model: Path) -> Iterator[tuple[str, int]]:
    engine = FakeEngine(ChatTokenizer.from_pretrained(str(demo_model)))
    settings = gateway_settings(grpc_port=None, http={"body_timeout_s": TIMEOUT_S})
    app = create_app(settings, [engine])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        http=guarded_protocol(8 * 1024, TIMEOUT_S, PER_CONNECTION),
        timeout_keep_alive=30,
    )
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    yield "127.0.0.1", port
    srv.should_exit = True
    thread.join(timeout=10)


def _read_all(sock: socket.socket, timeout_s: float = 10.0) -> bytes:
    """Everything until the server closes the connection."""
    sock.settimeout(timeout_s)
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def _response(raw: bytes) -> tuple[int, dict[str, object]]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_an_oversized_head_is_431_and_closed(server: tuple[str, int]) -> None:
    with socket.create_connection(server) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 64 * 1024 + b"\r\n\r\n")
        status, body = _response(_read_all(s))
    assert status == 431
    assert body["error"] == {
        "message": "The request line and headers exceed 8192 bytes",
        "type": "invalid_request_error",
        "param": None,
        "code": "request_header_fields_too_large",
    }


@pytest.mark.parametrize("sent", [b"", b"GET /healthz HTTP/1.1\r\nHost: x\r\n"])
def test_a_head_that_does_not_arrive_in_time_is_408_and_closed(
    server: tuple[str, int], sent: bytes
) -> None:
    with socket.create_connection(server) as s:
        s.sendall(sent)  # then nothing more (slowloris)
        status, body = _response(_read_all(s))
    assert status == 408
    assert body["error"]["code"] == "request_timeout"  # type: ignore[index]


def test_kept_alive_requests_pass_and_a_slow_second_head_is_408(server: tuple[str, int]) -> None:
    with socket.create_connection(server) as s:
        s.settimeout(10)
        for _ in range(2):
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            got = s.recv(65536)
            assert got.startswith(b"HTTP/1.1 200")
            time.sleep(TIMEOUT_S * 1.5)  # idle between requests is kept-alive, not a slow head
        s.sendall(b"GET /healthz HTTP/1.1\r\n")
        status, _ = _response(_read_all(s))
    assert status == 408


def test_a_body_that_stalls_is_408(server: tuple[str, int]) -> None:
    with socket.create_connection(server) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            b'content-length: 100\r\n\r\n{"model": '
        )
        raw = _read_all(s)
    status, body = _response(raw)
    assert status == 408
    assert body["error"]["code"] == "request_timeout"  # type: ignore[index]


def test_many_slow_clients_are_all_shed_and_service_goes_on(server: tuple[str, int]) -> None:
    slow = [socket.create_connection(server) for _ in range(100)]
    try:
        for s in slow:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        statuses = {_response(_read_all(s))[0] for s in slow}
    finally:
        for s in slow:
            s.close()
    assert statuses == {408}
    with socket.create_connection(server) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert _read_all(s).startswith(b"HTTP/1.1 200")


def test_a_kept_alive_connection_is_closed_after_its_last_request(
    server: tuple[str, int],
) -> None:
    with socket.create_connection(server) as s:
        s.settimeout(10)
        heads = []
        for _ in range(PER_CONNECTION):
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            got = s.recv(65536)
            assert got.startswith(b"HTTP/1.1 200")
            heads.append(got.partition(b"\r\n\r\n")[0].lower())
        assert s.recv(65536) == b""  # then the server closed it
    assert [b"connection: close" in h for h in heads] == [False] * (PER_CONNECTION - 1) + [True]
