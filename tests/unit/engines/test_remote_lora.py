"""A remote replica's LoRA adapters through its own routes (a loopback stand-in for
vLLM's OpenAI server): learned from /v1/models (``parent`` and ``root``), loaded through
/v1/load_lora_adapter (a name at another path unloaded first), a refusal named, an
unload of what it does not hold False."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import web

from engines.errors import EngineInputError
from engines.lora import LoraRef
from engines.vllm.remote import RemoteVllmConfig, RemoteVllmEngine
from tests.loopback import free_port

BASE = "vcache-demo"


class FakeVllm:
    """vLLM's /v1/models and its runtime LoRA routes, as its server answers them."""

    def __init__(self) -> None:
        self.loras: dict[str, str] = {}
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/load_lora_adapter", self.load)
        app.router.add_post("/v1/unload_lora_adapter", self.unload)
        return app

    async def models(self, _: web.Request) -> web.Response:
        data = [{"id": BASE, "root": "/models/demo", "parent": None}]
        data += [{"id": n, "root": p, "parent": BASE} for n, p in self.loras.items()]
        return web.json_response({"object": "list", "data": data})

    async def load(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append(("load", body))
        name, path = body["lora_name"], body["lora_path"]
        if name in self.loras:
            return _error(400, f"The lora adapter '{name}' has already been loaded.")
        if "wide" in path:
            return _error(400, "LoRA rank 16 is greater than max_lora_rank 8.")
        self.loras[name] = path
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append(("unload", body))
        if self.loras.pop(body["lora_name"], None) is None:
            return _error(404, f"The lora adapter '{body['lora_name']}' cannot be found.")
        return web.Response(text="Success")


def _error(status: int, message: str) -> web.Response:
    body = {"error": {"message": message, "type": "BadRequestError", "code": status}}
    return web.json_response(body, status=status)


async def _run(fake: FakeVllm) -> None:
    runner = web.AppRunner(fake.app())
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    config = RemoteVllmConfig(
        url=f"http://127.0.0.1:{port}",
        tokenizer="unused",
        control_secret="s",
        served_model_name=BASE,
    )
    engine = RemoteVllmEngine(config)
    try:
        assert engine.lora_enabled and await engine.adapters() == []
        a = LoraRef("a", "/loras/a")
        await engine.load_adapter(a)
        assert await engine.adapters() == [a]
        await engine.load_adapter(a)  # held at that path: nothing sent
        assert [c for c, _ in fake.calls] == ["load"]
        moved = LoraRef("a", "/loras/a-v2")
        await engine.load_adapter(moved)  # re-pointed: unloaded, then loaded
        assert [c for c, _ in fake.calls] == ["load", "unload", "load"]
        assert await engine.adapters() == [moved]
        with pytest.raises(EngineInputError) as err:
            await engine.load_adapter(LoraRef("w", "/loras/wide"))
        assert "'w'" in str(err.value) and "max_lora_rank 8" in str(err.value)
        assert await engine.unload_adapter("a") is True
        assert await engine.unload_adapter("a") is False
        assert await engine.adapters() == []
    finally:
        await engine.close()
        await runner.cleanup()


def test_a_remote_replicas_adapters_go_through_its_own_routes() -> None:
    asyncio.run(_run(FakeVllm()))
