"""Pure ASGI middleware: the request body's size and pace, and per-route request counts."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

from gateway.core.errors import APIError, PayloadTooLarge, RequestTimeout
from gateway.core.metrics import Metrics
from gateway.http import anthropic

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


async def _send_error(send: Send, exc: APIError, scope: Scope, close: bool = False) -> None:
    """The error as a whole response in the API's shape (Anthropic's on the Messages
    routes); ``close``: the connection too (a body left unread)."""
    status, extra = exc.status, []
    if str(scope.get("path", "")).startswith(anthropic.PREFIX):
        rid = anthropic.new_request_id()
        status, event = anthropic.error_event(exc, rid)
        body = event.model_dump_json(exclude_none=True).encode()
        extra.append((b"request-id", rid.encode()))
    else:
        body = json.dumps(exc.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += extra
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class BodyLimitMiddleware:
    """Refuse bodies over ``limit`` bytes with 413, and bodies whose next chunk takes longer
    than ``chunk_timeout_s`` with 408, before any handler parses them.

    The body is read up front (it is bounded by the limit) and replayed to the
    app, so a chunked upload without Content-Length is limited too.
    """

    def __init__(
        self,
        app: ASGIApp,
        limit: int,
        metrics: Metrics,
        chunk_timeout_s: float = 30.0,
        path_limits: Mapping[str, int] | None = None,
    ) -> None:
        self.app = app
        self.limit = limit
        self.metrics = metrics
        self.chunk_timeout_s = chunk_timeout_s
        # a path's own limit in place of ``limit`` (a batch's upload)
        self.path_limits = dict(path_limits or {})

    def _too_large(self, limit: int) -> PayloadTooLarge:
        self.metrics.errors.labels(PayloadTooLarge.type).inc()
        return PayloadTooLarge(
            f"The request body exceeds the limit of {limit} bytes",
            code="request_too_large",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        limit = self.path_limits.get(scope.get("path", ""), self.limit)
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                await _send_error(send, self._too_large(limit), scope)
                return
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                async with asyncio.timeout(self.chunk_timeout_s):  # no task a chunk
                    message = await receive()
            except TimeoutError:
                self.metrics.errors.labels(RequestTimeout.type).inc()
                slow = RequestTimeout(
                    f"The request body did not arrive in time (no data for "
                    f"{self.chunk_timeout_s:g} s)",
                    code="request_timeout",
                )
                await _send_error(send, slow, scope, close=True)
                return
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _send_error(send, self._too_large(limit), scope, close=True)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


# a batch's upload: the batch's whole input in one body (batches.max_upload_bytes)
UPLOAD_PATHS = ("/v1/files", "/v1/messages/batches")

# the routes that put work on a model (vLLM's server load counts the same kind)
GENERATION_PATHS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/chat/completions/batch",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
        "/invocations",
    }
)


class ServerLoad:
    """Requests on the generation routes now, from arrival to the last byte of the answer
    (vLLM's ``/load``, which routers poll to pick the least loaded server)."""

    def __init__(self) -> None:
        self.running = 0


class RequestMetricsMiddleware:
    """Count every /v1 request by route template and final status, and time it (to the
    last byte of the response: a stream's whole length); keep the server load."""

    def __init__(self, app: ASGIApp, metrics: Metrics, load: ServerLoad | None = None) -> None:
        self.app = app
        self.metrics = metrics
        self.load = load or ServerLoad()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and path in GENERATION_PATHS:
            self.load.running += 1
            try:
                await self._measured(scope, receive, send)
            finally:
                self.load.running -= 1
        else:
            await self._measured(scope, receive, send)

    async def _measured(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        status = 499  # no response started: the client went away first (nginx's code)

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        t0 = time.perf_counter()
        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            label = getattr(route, "path", None) or "unmatched"
            self.metrics.requests.labels(label, str(status)).inc()
            self.metrics.request_time.labels(label).observe(time.perf_counter() - t0)
