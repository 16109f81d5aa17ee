"""The remote replica's HTTP transport against a raw server that closes a kept-alive
connection as a request arrives on it (what a replica whose keep-alive ran out does in
the instant the gateway reuses the connection): the request goes again, once, on a new
connection; a replica that refuses connections is not retried."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from engines.errors import EngineUnavailable
from engines.vllm.remote import RemoteVllmConfig, RemoteVllmEngine
from tests.loopback import free_port


@dataclass
class ClosingServer:
    """Answers the first request of each connection; closes it, unanswered, on the next."""

    connections: int = 0
    answered: list[str] = field(default_factory=list)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        first = True
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                await reader.readexactly(length)
                if not first:
                    return  # closed under the request
                first = False
                self.answered.append(head.split(b" ")[1].decode())
                body = json.dumps({"result": {"block_size": 128}}).encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(body), body)
                )
                await writer.drain()
        except asyncio.IncompleteReadError:
            pass
        finally:
            writer.close()


async def _serving(behaviour: ClosingServer, test: Callable[[int], Awaitable[None]]) -> None:
    port = free_port()
    async with await asyncio.start_server(behaviour.handle, "127.0.0.1", port):
        await test(port)


def _engine(port: int) -> RemoteVllmEngine:
    return RemoteVllmEngine(
        RemoteVllmConfig(url=f"http://127.0.0.1:{port}", tokenizer="unused", control_secret="s")
    )


def test_a_request_on_a_connection_closed_under_it_goes_again_on_a_new_one() -> None:
    behaviour = ClosingServer()
    engine = _engine(0)

    async def twice(port: int) -> None:
        nonlocal engine
        engine = _engine(port)
        try:
            assert await engine.call_core("vcache_cache_stats") == {"block_size": 128}
            # the pooled connection is reused, and the server closes it under this request
            assert await engine.call_core("vcache_cache_stats") == {"block_size": 128}
        finally:
            await engine.close()

    asyncio.run(_serving(behaviour, twice))
    assert engine.stale_retries == 1
    assert behaviour.connections == 2
    assert behaviour.answered == ["/vcache/v1/control/vcache_cache_stats"] * 2


def test_a_refused_connection_is_not_retried() -> None:
    engine = _engine(free_port())  # nothing listens there

    async def once() -> None:
        try:
            with pytest.raises(EngineUnavailable, match="unreachable"):
                await engine.call_core("vcache_cache_stats")
        finally:
            await engine.close()

    asyncio.run(once())
    assert engine.stale_retries == 0


def test_idle_connections_are_dropped_before_vllms_keep_alive_ends() -> None:
    from vllm import envs

    config = RemoteVllmConfig(url="http://x", tokenizer="t", control_secret="s")
    assert config.keepalive_s < envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE
