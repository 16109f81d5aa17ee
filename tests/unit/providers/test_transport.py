"""The provider client's transport seam: an ASGI app in-process streams as it sends,
sees a client that leaves as a disconnect, and fails the way a socket does; the
client's retry rules are the same over either transport."""

from __future__ import annotations

import asyncio
from collections.abc import MutableMapping
from typing import Any

import pytest

from engines.providers.base import Rendered
from engines.providers.client import ProviderClient
from engines.providers.errors import ProviderRateLimited, ProviderUnavailable
from engines.providers.retry import RetryPolicy
from engines.providers.specs import PROVIDERS
from engines.providers.transport import AiohttpTransport, AsgiTransport, TransportError
from tests.loopback import free_port

Scope = MutableMapping[str, Any]


class Chunked:
    """Sends its body in three chunks, the second only once the first was read."""

    def __init__(self) -> None:
        self.read_first = asyncio.Event()
        self.disconnected = asyncio.Event()
        self.seen: Scope = {}

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        self.seen = scope
        request = await receive()
        self.seen["body"] = request["body"]
        head = [(b"content-type", b"text/plain"), (b"X-Custom", b"yes")]
        await send({"type": "http.response.start", "status": 200, "headers": head})
        await send({"type": "http.response.body", "body": b"one ", "more_body": True})
        await self.read_first.wait()
        await send({"type": "http.response.body", "body": b"two ", "more_body": True})
        if (await receive())["type"] == "http.disconnect":
            self.disconnected.set()


def test_an_asgi_app_streams_each_chunk_as_it_is_sent() -> None:
    app = Chunked()
    t = AsgiTransport(app)

    async def main() -> list[bytes]:
        got = []
        async with t.request("POST", "http://emu.test/v1/x?a=1", {"k": "v"}, b"{}") as r:
            assert r.status == 200 and r.headers["x-custom"] == "yes"  # any case
            async for chunk in r.chunks():
                got.append(chunk)
                app.read_first.set()  # the second is sent only after the first came
                if len(got) == 2:
                    break  # the client leaves mid-stream
        await asyncio.wait_for(app.disconnected.wait(), 5)  # and the app saw it leave
        return got

    assert asyncio.run(main()) == [b"one ", b"two "]
    assert app.seen["path"] == "/v1/x" and app.seen["query_string"] == b"a=1"
    assert (b"k", b"v") in app.seen["headers"] and app.seen["body"] == b"{}"


async def _broken(scope: Scope, receive: Any, send: Any) -> None:
    raise ConnectionResetError("gone")


def test_an_app_that_breaks_is_a_transport_error() -> None:
    async def main() -> None:
        async with AsgiTransport(_broken).request("GET", "http://emu.test/", {}) as r:
            await r.read()

    with pytest.raises(TransportError, match="ConnectionResetError"):
        asyncio.run(main())


class Limited:
    """Answers 429 with a Retry-After first, then 200."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        self.calls += 1
        await receive()
        if self.calls == 1:
            head = [(b"retry-after", b"0"), (b"content-type", b"application/json")]
            body = b'{"error": {"message": "slow down"}}'
            await send({"type": "http.response.start", "status": 429, "headers": head})
        else:
            body = b'{"ok": true}'
            await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})


def _client(transport: Any, retries: int) -> ProviderClient:
    async def no_sleep(_: float) -> None:
        return None

    adapter = PROVIDERS["openai"].adapter()
    return ProviderClient(
        adapter,
        "http://emu.test/v1",
        "sk-x",
        RetryPolicy(retries),
        sleep=no_sleep,
        transport=transport,
    )


def _rendered() -> Rendered:
    return Rendered("/chat/completions", b"{}", b"", stream=False)


def test_the_clients_retry_rules_hold_over_the_asgi_transport() -> None:
    app = Limited()
    assert asyncio.run(_client(AsgiTransport(app), 2).send(_rendered())) == {"ok": True}
    assert app.calls == 2  # the 429 retried after its Retry-After
    app = Limited()
    with pytest.raises(ProviderRateLimited):
        asyncio.run(_client(AsgiTransport(app), 0).send(_rendered()))


def test_nothing_listening_is_unavailable_over_aiohttp() -> None:
    async def main() -> None:
        c = ProviderClient(
            PROVIDERS["openai"].adapter(),
            f"http://127.0.0.1:{free_port()}/v1",
            "sk-x",
            RetryPolicy(0),
            transport=None,
        )
        try:
            await c.send(_rendered())
        finally:
            await c.aclose()

    with pytest.raises(ProviderUnavailable, match="transport error"):
        asyncio.run(main())


def test_aiohttp_transport_errors_are_transport_errors() -> None:
    async def main() -> None:
        t = AiohttpTransport(timeout_s=2)
        try:
            async with t.request("GET", f"http://127.0.0.1:{free_port()}/", {}) as r:
                await r.read()
        finally:
            await t.aclose()

    with pytest.raises(TransportError):
        asyncio.run(main())
