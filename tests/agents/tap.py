"""A pass-through HTTP tap between an agent CLI and the gateway: every exchange recorded.

The agent is pointed at the tap; the tap sends each request on to the gateway
unchanged (a new upstream connection per request, hop-by-hop headers left out)
and streams the answer back as it comes, chunk by chunk.  It records what the
gateway's own counters cannot say per request: the status, the gateway's
``x-vcache-*`` headers (the predicted cached tokens among them), and, for an
answer that is not a 2xx, the request and the error body, so a refusal can be
reported exactly.  Prompts stay in memory; :meth:`Exchange.capture` gives an
exchange in the form of ``tests/agents/data``'s recordings (credentials left out),
for a run that keeps them.
"""

from __future__ import annotations

import contextlib
import gzip
import http.client
import json
import threading
import time
import zlib
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

UPSTREAM_TIMEOUT_S = 600.0
RECORD_WAIT_S = 30.0  # how long a reader of the exchanges waits for a relay to record
# RFC 9110 7.6.1, plus the headers the tap sets itself
_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)

_SECRET = frozenset({"authorization", "x-api-key", "cookie"})


@dataclass
class Exchange:
    """One request the agent made, and how it was answered."""

    method: str
    path: str
    request: bytes
    request_headers: dict[str, str] = field(default_factory=dict)  # as sent, hop-by-hop out
    status: int = 0  # 0: no answer (the gateway could not be reached)
    headers: dict[str, str] = field(default_factory=dict)  # the gateway's x-vcache-* and ids
    error: str | None = None  # the body of an answer that is not a 2xx (or what failed)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def body(self) -> Any:
        """The request body, decoded (None when it is not JSON)."""
        try:
            return json.loads(self.request)
        except ValueError:
            return None

    def capture(self, scenario: str) -> dict[str, Any]:
        """The exchange as ``tests/agents/data`` records one (the unit tier sends every
        recording again): method, path, query, the request's headers without credentials,
        its body, the scenario it came from and the status it was answered with."""
        u = urlsplit(self.path)
        headers = {k: v for k, v in self.request_headers.items() if k.lower() not in _SECRET}
        return {
            "method": self.method,
            "path": u.path,
            "query": u.query,
            "headers": headers,
            "body": self.body(),
            "scenario": scenario,
            "answered": self.status,
        }

    def predicted(self) -> int | None:
        v = self.headers.get("x-vcache-predicted-cached-tokens")
        return None if v is None else int(v)

    def record(self) -> dict[str, Any]:
        """What a summary keeps of it (the error body whole, the prompt by size)."""
        body = self.body()
        model = body.get("model") if isinstance(body, dict) else None
        return {
            "method": self.method,
            "path": self.path,
            "status": self.status,
            "model": model,
            "request_bytes": len(self.request),
            "headers": self.headers,
            "error": self.error,
            "seconds": round(self.seconds, 3),
        }


def _decoded(data: bytes, encoding: str | None) -> str:
    with contextlib.suppress(OSError, zlib.error):
        if encoding == "gzip":
            data = gzip.decompress(data)
        elif encoding == "deflate":
            data = zlib.decompress(data)
    return data.decode(errors="replace")


class Tap:
    """``with Tap(gateway_url) as tap:`` point the agent at ``tap.url``; read
    ``tap.exchanges`` after."""

    def __init__(self, upstream: str) -> None:
        u = urlsplit(upstream)
        if u.scheme != "http" or u.hostname is None:
            raise ValueError(f"the tap relays to an http:// gateway, not {upstream!r}")
        self._host, self._port = u.hostname, u.port or 80
        self._lock = threading.Condition()
        self._exchanges: list[Exchange] = []
        self._relaying = 0  # exchanges begun and not yet recorded
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    @property
    def exchanges(self) -> list[Exchange]:
        """The exchanges so far, once every one begun is recorded (a relay records its
        exchange after the agent has its answer: a reader that just got one waits for it)."""
        with self._lock:
            self._lock.wait_for(lambda: self._relaying == 0, timeout=RECORD_WAIT_S)
            return list(self._exchanges)

    def __enter__(self) -> Tap:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def _begin(self) -> None:
        with self._lock:
            self._relaying += 1

    def _add(self, x: Exchange) -> None:
        with self._lock:
            self._exchanges.append(x)
            self._relaying -= 1
            self._lock.notify_all()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        tap = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                """Quiet: the exchanges are the log."""

            def do_GET(self) -> None:
                tap._relay(self)

            do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_GET

        return Handler

    def _read_body(self, h: BaseHTTPRequestHandler) -> bytes:
        if h.headers.get("transfer-encoding", "").lower() == "chunked":
            parts = []
            while size := int(h.rfile.readline().split(b";")[0].strip() or b"0", 16):
                parts.append(h.rfile.read(size))
                h.rfile.readline()
            while h.rfile.readline() not in (b"\r\n", b"\n", b""):
                pass  # trailers
            return b"".join(parts)
        n = int(h.headers.get("content-length") or 0)
        return h.rfile.read(n) if n else b""

    def _relay(self, h: BaseHTTPRequestHandler) -> None:
        t0 = time.monotonic()
        headers = {k: v for k, v in h.headers.items() if k.lower() not in _HOP}
        x = Exchange(h.command, h.path, self._read_body(h), headers)
        up = http.client.HTTPConnection(self._host, self._port, timeout=UPSTREAM_TIMEOUT_S)
        self._begin()  # recorded in the finally below, however the relay ends
        try:
            up.request(h.command, h.path, body=x.request or None, headers=headers)
            r = up.getresponse()
            x.status = r.status
            x.headers = {
                k.lower(): v
                for k, v in r.getheaders()
                if k.lower().startswith("x-vcache-") or k.lower() in ("request-id", "retry-after")
            }
            self._answer(h, r, x)
        except (OSError, http.client.HTTPException) as exc:
            x.error = x.error or f"tap: {exc!r}"
            if x.status == 0:  # nothing sent to the agent yet: say so as a 502
                with contextlib.suppress(OSError):
                    msg = json.dumps({"error": {"message": x.error}}).encode()
                    h.send_response(502)
                    h.send_header("content-type", "application/json")
                    h.send_header("content-length", str(len(msg)))
                    h.end_headers()
                    h.wfile.write(msg)
            h.close_connection = True
        finally:
            up.close()
            x.seconds = time.monotonic() - t0
            self._add(x)

    def _answer(self, h: BaseHTTPRequestHandler, r: http.client.HTTPResponse, x: Exchange) -> None:
        """Stream the gateway's answer to the agent as it arrives."""
        h.send_response_only(r.status, r.reason)
        for k, v in r.getheaders():
            if k.lower() not in _HOP:
                h.send_header(k, v)
        length = r.getheader("content-length")
        bodiless = h.command == "HEAD" or r.status in (204, 304)
        if length is not None:
            h.send_header("content-length", length)
        elif not bodiless:
            h.send_header("transfer-encoding", "chunked")
        h.end_headers()
        kept = bytearray()
        while not bodiless and (chunk := r.read1(1 << 16)):
            if not x.ok and len(kept) < 1 << 16:
                kept += chunk
            if length is None:
                h.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            else:
                h.wfile.write(chunk)
            h.wfile.flush()
        if length is None and not bodiless:
            h.wfile.write(b"0\r\n\r\n")
            h.wfile.flush()
        if not x.ok:
            x.error = _decoded(bytes(kept), r.getheader("content-encoding"))
