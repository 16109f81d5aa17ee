"""The provider client's transport seam: how a request reaches a provider.

:class:`ProviderClient` speaks HTTP through a :class:`Transport`; it never
touches the socket library itself.  Two transports exist:

- :class:`AiohttpTransport`, the default: one ``aiohttp`` session, made on
  first use in the running loop (a quarter of ``httpx``'s CPU per call,
  measured against the emulator), no cookie jar, a connect timeout and a
  per-read timeout (a long stream is fine as long as it keeps sending);
- :class:`AsgiTransport`: an ASGI application called in-process (the
  provider emulator in tests), its answer streamed chunk by chunk as it is
  sent, a client that leaves seen by the app as a disconnect.

Either raises :class:`TransportError` for what did not reach an answer
(refused, reset, timed out), so the client's retry rules do not depend on
which transport carried the request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

import aiohttp
from multidict import CIMultiDict


class TransportError(Exception):
    """The request did not reach an answer (``timeout``: it ran out of time)."""

    def __init__(self, message: str, timeout: bool = False) -> None:
        super().__init__(message)
        self.timeout = timeout


class Response(Protocol):
    @property
    def status(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    async def read(self) -> bytes:
        """The whole body."""
        ...

    def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives."""
        ...


class Transport(Protocol):
    def request(
        self, method: str, url: str, headers: Mapping[str, str], body: bytes | None = None
    ) -> contextlib.AbstractAsyncContextManager[Response]:
        """The response to one request, open until the context ends."""
        ...

    async def aclose(self) -> None: ...


def _error(exc: BaseException) -> TransportError:
    return TransportError(type(exc).__name__, timeout=isinstance(exc, TimeoutError))


@dataclass
class _AiohttpResponse:
    raw: aiohttp.ClientResponse

    @property
    def status(self) -> int:
        return self.raw.status

    @property
    def headers(self) -> Mapping[str, str]:
        return self.raw.headers

    async def read(self) -> bytes:
        try:
            return await self.raw.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _error(exc) from exc

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for raw in self.raw.content.iter_any():
                yield raw
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _error(exc) from exc


class AiohttpTransport:
    def __init__(self, timeout_s: float = 60.0) -> None:
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=min(timeout_s, 10.0), sock_read=timeout_s
        )
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=self._timeout, cookie_jar=aiohttp.DummyCookieJar()
            )
        return self._session

    @contextlib.asynccontextmanager
    async def request(
        self, method: str, url: str, headers: Mapping[str, str], body: bytes | None = None
    ) -> AsyncIterator[Response]:
        try:
            async with self._http().request(method, url, data=body, headers=headers) as raw:
                yield _AiohttpResponse(raw)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _error(exc) from exc

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


Message = MutableMapping[str, Any]
App = Callable[
    [Message, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]],
    Awaitable[None],
]
_END = object()
DISCONNECT_GRACE_S = 1.0  # an app still running when its client left is then cancelled


@dataclass
class _AsgiResponse:
    status: int
    headers: Mapping[str, str]
    _body: asyncio.Queue[object]

    async def chunks(self) -> AsyncIterator[bytes]:
        while True:
            part = await self._body.get()
            if part is _END:
                return
            if isinstance(part, BaseException):
                raise _error(part) from part
            assert isinstance(part, bytes)
            yield part

    async def read(self) -> bytes:
        return b"".join([c async for c in self.chunks()])


class AsgiTransport:
    """Requests to an ASGI app in this process and loop (no socket, no subprocess)."""

    def __init__(self, app: App) -> None:
        self._app = app

    @contextlib.asynccontextmanager
    async def request(
        self, method: str, url: str, headers: Mapping[str, str], body: bytes | None = None
    ) -> AsyncIterator[Response]:
        u = urlsplit(url)
        scope: Message = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": method,
            "scheme": u.scheme or "http",
            "path": u.path or "/",
            "raw_path": (u.path or "/").encode(),
            "query_string": u.query.encode(),
            "root_path": "",
            "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
            "server": (u.hostname or "asgi", u.port or 80),
            "client": ("127.0.0.1", 0),
        }
        started: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        body_q: asyncio.Queue[object] = asyncio.Queue()
        left = asyncio.Event()  # the client is done with the response
        sent_body = False

        async def receive() -> Message:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": body or b"", "more_body": False}
            await left.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            if left.is_set():  # as a server does once its client has gone
                raise OSError("the client has gone")
            if message["type"] == "http.response.start":
                started.set_result(message)
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    body_q.put_nowait(bytes(message["body"]))
                if not message.get("more_body", False):
                    body_q.put_nowait(_END)

        async def run() -> None:
            try:
                await self._app(scope, receive, send)
            except Exception as exc:  # the app broke: a reset connection to the client
                if not started.done():
                    started.set_exception(_error(exc))
                body_q.put_nowait(exc)
            else:
                body_q.put_nowait(_END)  # an app that ended without saying so

        task = asyncio.create_task(run())
        try:
            start = await started
            head = CIMultiDict(
                (k.decode("latin-1"), v.decode("latin-1")) for k, v in start["headers"]
            )
            yield _AsgiResponse(int(start["status"]), head, body_q)
        finally:
            left.set()  # the app's next receive is a disconnect: let it end on its own
            await asyncio.wait({task}, timeout=DISCONNECT_GRACE_S)
            if not task.done():
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def aclose(self) -> None:
        return None
