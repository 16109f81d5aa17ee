"""The HTTP server: uvicorn's httptools protocol with limits on the request head.

uvicorn parses a request's head (request line and headers) before the app
sees anything, and sets no bound on it: a 64 MB header is buffered and
parsed, and a client that sends a head one byte a minute (slowloris) holds a
connection forever.  :func:`guarded_protocol` adds what a gateway in front of
GPUs needs:

- a head larger than ``max_header_bytes`` is answered 431 and the
  connection closed, with at most one read chunk buffered past the limit;
- a head that has not fully arrived ``header_timeout_s`` after the
  connection opened (or after the request's first byte, on a kept-alive
  connection) is answered 408 and the connection closed;
- a kept-alive connection serves at most ``max_requests_per_connection``
  requests; the last is answered with ``connection: close`` (nginx's
  ``keepalive_requests``).  The kernel spreads connections over the
  ``--workers`` sharing a port, not requests: a client that reconnects lands
  on a worker drawn again, so long-lived clients spread over the workers
  instead of staying where they first connected.

Each response's head (status line and headers) goes out with its body's first bytes, in
one write: a whole answer in one system call instead of two, a stream's head with its
first event (:class:`HeadWithBody`).  Nothing waits for that: the body follows in the
same turn of the loop (a response that sends none then has its head flushed at the
loop's next turn, or when the connection closes).

Body reads are bounded in the ASGI layer (``gateway/http/middleware.py``): size,
and the wait for each body chunk.  Idle kept-alive connections close after
``keep_alive_s`` (uvicorn's own timer) and at most ``max_connections`` are
served at once (uvicorn answers 503 beyond that).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


def _reply(status: int, code: str, message: str) -> bytes:
    """A complete response in the API's error shape, closing the connection."""
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    body = json.dumps({"error": error}).encode()
    head = (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    ).encode()
    return head + body


_REASONS = {408: "Request Timeout", 431: "Request Header Fields Too Large"}


class _Refused(Exception):
    """Raised from a parser callback to stop parsing a refused request."""


class HeadWithBody:
    """The transport a response writes to, holding the response's first write (its head)
    until its next (the body's first bytes) so both go out in one system call; held
    at most until the loop's next turn or the connection's close.  Each write is a
    system call that also wakes the reader: one fewer per response is a share of a
    whole answer's frontend CPU (docs/benchmarks.md)."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._head: bytes | None = None
        self._first = True  # no write yet: the next one is the head

    def write(self, data: bytes) -> None:
        if self._first:
            self._first = False
            self._head = data
            self._loop.call_soon(self.flush)  # a head with no body after it in this turn
            return
        if self._head is not None:
            data, self._head = self._head + data, None
        self._transport.write(data)

    def flush(self) -> None:
        if self._head is not None:
            head, self._head = self._head, None
            if not self._transport.is_closing():
                self._transport.write(head)

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def close(self) -> None:
        self.flush()
        self._transport.close()


class GuardedProtocol(HttpToolsProtocol):
    """:class:`HttpToolsProtocol` with a bounded, timed request head (see module doc)."""

    max_header_bytes = 64 * 1024
    header_timeout_s = 10.0
    max_requests_per_connection = 0  # 0: no limit

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True
        self._head_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._refused = False
        self._requests = 0  # begun on this connection

    def _arm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _refuse(self, status: int, code: str, message: str) -> None:
        self._disarm()
        self._refused = True
        if not self.transport.is_closing():
            self.transport.write(_reply(status, code, message))
            self.transport.close()

    def _too_large(self) -> None:
        message = f"The request line and headers exceed {self.max_header_bytes} bytes"
        self._refuse(431, "request_header_fields_too_large", message)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._in_head:
            self._refuse(408, "request_timeout", "The request headers did not arrive in time")

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        # Still inside the head after this chunk and over the limit: the bytes so far
        # were all head (the body only starts once the head is complete).
        if self._in_head and self._head_bytes > self.max_header_bytes:
            self._too_large()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if not self._in_head:  # the first byte of the next request on this connection
            self._in_head, self._head_bytes = True, 0
            self._arm()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm()
        size = len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers)
        if size > self.max_header_bytes:  # the whole head came in one read
            self._too_large()
            raise _Refused  # stops the parser (uvicorn's 400 for it is suppressed below)
        super().on_headers_complete()
        if self.cycle is not None:
            self.cycle.transport = HeadWithBody(self.transport, self.loop)  # type: ignore[assignment]
        self._requests += 1
        cap = self.max_requests_per_connection
        if cap and self._requests >= cap and self.cycle is not None:
            self.cycle.keep_alive = False  # answered with connection: close

    def send_400_response(self, msg: str) -> None:
        if not self._refused:
            super().send_400_response(msg)


def guarded_protocol(
    max_header_bytes: int, header_timeout_s: float, max_requests_per_connection: int = 0
) -> type[GuardedProtocol]:
    """A protocol class for ``uvicorn.run(http=...)`` with these limits."""
    limits = {
        "max_header_bytes": max_header_bytes,
        "header_timeout_s": header_timeout_s,
        "max_requests_per_connection": max_requests_per_connection,
    }
    return type("GatewayHttpProtocol", (GuardedProtocol,), limits)
