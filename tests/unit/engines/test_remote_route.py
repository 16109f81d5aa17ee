"""Which route a remote replica's token ids go to, decided at start from its OpenAPI
document: ``auto`` takes the token-in/token-out route where vLLM lists it (a server
started with --enable-scale-out) and the completions route where it does not; a
replica configured for ``generate`` that does not offer it does not start."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from aiohttp import web

from engines.errors import EngineUnavailable
from engines.vllm.remote import RemoteVllmConfig, RemoteVllmEngine
from tests.loopback import free_port

GENERATE = "/inference/v1/generate"


async def _replica(paths: list[str] | None) -> tuple[web.AppRunner, int]:
    """A stand-in for vLLM's server: its model card, the control call ``start`` makes, and
    an OpenAPI document listing ``paths`` (None: no document, as --disable-fastapi-docs)."""

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m", "max_model_len": 64}]})

    async def control(_: web.Request) -> web.Response:
        return web.json_response({"result": {"block_size": 16}})

    async def openapi(_: web.Request) -> web.Response:
        if paths is None:
            return web.json_response({"detail": "Not Found"}, status=404)
        return web.json_response({"openapi": "3.1.0", "paths": {p: {} for p in paths}})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/vcache/v1/control/{method}", control)
    app.router.add_get("/openapi.json", openapi)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, port


def _start(demo_model: Path, paths: list[str] | None, api: str) -> str:
    async def main() -> str:
        runner, port = await _replica(paths)
        engine = RemoteVllmEngine(
            RemoteVllmConfig(
                url=f"http://127.0.0.1:{port}",
                tokenizer=str(demo_model),
                control_secret="s",
                api=api,  # type: ignore[arg-type]
            )
        )
        try:
            await engine.start()
            return engine.api
        finally:
            await engine.close()
            await runner.cleanup()

    return asyncio.run(main())


def test_auto_takes_the_generate_route_where_the_replica_lists_it(demo_model: Path) -> None:
    assert _start(demo_model, ["/v1/completions", GENERATE], "auto") == "generate"
    assert _start(demo_model, ["/v1/completions"], "auto") == "completions"
    assert _start(demo_model, None, "auto") == "completions"


def test_a_configured_route_is_kept_or_the_replica_does_not_start(demo_model: Path) -> None:
    assert _start(demo_model, ["/v1/completions", GENERATE], "completions") == "completions"
    assert _start(demo_model, ["/v1/completions", GENERATE], "generate") == "generate"
    with pytest.raises(EngineUnavailable, match="--enable-scale-out"):
        _start(demo_model, ["/v1/completions"], "generate")
