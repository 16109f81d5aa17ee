"""A core call sent ahead of the requests after it (``VllmEngine.send_core``), on vLLM's
own ``AsyncMPClient`` (its input socket stood in for): on the socket before the call
returns, its reply the core's, its failures translated as ``call_core``'s; a client
that routes requests among several cores, or lacks a part it uses, sends nothing ahead.
"""

from __future__ import annotations

import asyncio
import gc
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.v1.engine import EngineCoreRequestType
from vllm.v1.engine.core_client import AsyncMPClient, DPAsyncMPClient
from vllm.v1.engine.exceptions import EngineDeadError

from engines.errors import EngineUnavailable
from engines.vllm.engine import VllmEngine, _ordered_client
from engines.vllm.engine_config import VllmEngineConfig


def _client(cls: type[AsyncMPClient] = AsyncMPClient) -> Any:
    """vLLM's client as its engine uses it, its socket a list of what was sent."""
    client: Any = object.__new__(cls)
    client.utility_results = {}
    client.encoder = SimpleNamespace(encode=lambda obj: [obj])
    client.client_index = 0
    client.core_engine = b"core-0"
    client.sent = []
    client.dead = False
    client.send_result = None  # a future: the send is done when it is

    def send(message: tuple[Any, ...], engine: bytes) -> asyncio.Future[None]:
        if client.dead:
            raise EngineDeadError()
        client.sent.append((engine, message))
        if client.send_result is not None:  # queued behind other sends: done later
            queued: asyncio.Future[None] = client.send_result
            return queued
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    client._send_input_message = send
    client._ensure_output_queue_task = lambda: None
    return client


def _engine(client: Any) -> VllmEngine:
    engine = VllmEngine(VllmEngineConfig("m", "m"))
    llm = SimpleNamespace(engine_core=client)
    engine._llm = llm  # type: ignore[assignment]
    engine._ordered = _ordered_client(llm)  # type: ignore[arg-type]
    return engine


def test_only_a_one_core_client_with_every_part_sends_ahead() -> None:
    assert _ordered_client(SimpleNamespace(engine_core=_client())) is not None  # type: ignore[arg-type]
    dp = _client(DPAsyncMPClient)  # requests balanced among cores: no order with them
    assert _ordered_client(SimpleNamespace(engine_core=dp)) is None  # type: ignore[arg-type]
    older = _client()
    del older.utility_results
    assert _ordered_client(SimpleNamespace(engine_core=older)) is None  # type: ignore[arg-type]
    assert _ordered_client(SimpleNamespace(engine_core=object())) is None  # type: ignore[arg-type]
    assert not _engine(dp).core_ordered and _engine(_client()).core_ordered


def test_the_call_is_on_the_socket_when_it_returns_and_its_reply_is_the_cores(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        client = _client()
        engine = _engine(client)
        reply = engine.send_core("vcache_hold", "h1", [b"a"], 0.25, 4, 10.0)
        assert len(client.sent) == 1  # sent before anything awaited
        core, (kind, (_, call_id, method, args)) = client.sent[0]
        assert (core, kind, method, args) == (
            b"core-0",
            EngineCoreRequestType.UTILITY.value,
            "vcache_hold",
            ("h1", [b"a"], 0.25, 4, 10.0),
        )
        client.utility_results.pop(call_id).set_result({"held": 1, "refused": ""})
        assert await reply == {"held": 1, "refused": ""}

        failing = engine.send_core("vcache_hold", "h2", [], 0.25, 4, 10.0)
        call_id = client.sent[-1][1][1][1]
        client.utility_results.pop(call_id).set_exception(Exception("Call to vcache_hold"))
        with pytest.raises(EngineUnavailable, match="vcache_hold failed"):
            await failing

        nobody = engine.send_core("vcache_release", ["h2"])  # never awaited: logs nothing
        client.utility_results.popitem()[1].set_exception(Exception("gone"))
        await asyncio.sleep(0)
        del nobody
        gc.collect()

    asyncio.run(main())
    assert "never retrieved" not in caplog.text


def test_a_call_that_cannot_be_sent_fails_at_once_or_when_its_send_does() -> None:
    async def main() -> None:
        client = _client()
        engine = _engine(client)
        client.dead = True
        with pytest.raises(EngineUnavailable, match="vcache_hold failed"):
            engine.send_core("vcache_hold", "h1", [], 0.25, 4, 10.0)
        assert client.utility_results == {}

        client.dead = False
        client.send_result = asyncio.get_running_loop().create_future()
        reply = engine.send_core("vcache_hold", "h2", [], 0.25, 4, 10.0)
        assert len(client.utility_results) == 1
        client.send_result.set_exception(OSError("socket closed"))
        with pytest.raises(EngineUnavailable, match="socket closed"):
            await reply
        assert client.utility_results == {}

        engine._closed = True
        assert not engine.core_ordered
        with pytest.raises(EngineUnavailable):
            engine.send_core("vcache_hold", "h3", [], 0.25, 4, 10.0)

    asyncio.run(main())
