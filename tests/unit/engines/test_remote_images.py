"""Images on a remote replica (no engine started): what the generate route is sent,
checked against vLLM's own request model and media loader; the completions route refuses
them by name; the expansion the replica reports is compared with the gateway's (a stand-in
replica answering over HTTP)."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from PIL import Image
from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest as VllmGenerate
from vllm.multimodal.media import MediaConnector

from engines.base import EngineImage, GenerateChunk, GenerateRequest, SamplingOptions
from engines.errors import EngineInputError
from engines.vllm.remote import RemoteVllmConfig, RemoteVllmEngine
from engines.vllm.remote_wire import content_parts, expansion, expansion_differs, request_body
from gateway.core.config import Settings
from gateway.local.build import _vision_model
from tests.loopback import free_port

GENERATE = "/inference/v1/generate"
TEMPLATE = (1, 9, 2, 9, 3)  # 9: the image token
EXPANDED = (1, 7, 7, 7, 2, 7, 7, 3)


def _png(size: tuple[int, int], mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size).save(buf, format="PNG")
    return buf.getvalue()


IMAGES = (
    EngineImage(_png((32, 24)), "image/png", "blake3-of-a", None, 1, 3),
    EngineImage(_png((8, 64), "LA"), "image/png", "shot-1", "shot-1", 5, 2),
)


def _request(images: tuple[EngineImage, ...] = IMAGES, stream: bool = True) -> GenerateRequest:
    return GenerateRequest(
        request_id="r1",
        prompt_token_ids=EXPANDED if images else TEMPLATE,
        sampling=SamplingOptions(max_tokens=2, prompt_logprobs=None if stream else 1),
        cache_salt="salt",
        images=images,
        template_token_ids=TEMPLATE if images else None,
    )


def test_images_go_as_content_parts_with_the_template_ids() -> None:
    body = request_body("generate", _request(), "m")
    parsed = VllmGenerate.model_validate(body)  # vLLM's own request model takes it
    assert parsed.token_ids == list(TEMPLATE)  # the replica expands them, as vLLM embedded
    assert parsed.features is None and parsed.return_token_ids is True
    assert parsed.content_parts == content_parts(IMAGES)
    assert [p["uuid"] for p in parsed.content_parts] == ["blake3-of-a", "shot-1"]
    assert [p["type"] for p in parsed.content_parts] == ["image_url", "image_url"]


def test_a_text_request_is_sent_as_before() -> None:
    body = request_body("generate", _request(()), "m")
    assert body["token_ids"] == list(TEMPLATE)
    assert "content_parts" not in body and "return_token_ids" not in body


def test_the_replica_loads_each_data_url_to_the_original_bytes() -> None:
    connector = MediaConnector()
    sizes = []
    for part, image in zip(content_parts(IMAGES), IMAGES, strict=True):
        loaded: Any = connector.fetch_image(part["url"])
        assert loaded.original_bytes == image.data  # what vLLM would hash
        assert loaded.media.mode == "RGB"
        sizes.append(loaded.media.size)
    assert sizes == [(32, 24), (8, 64)]


def test_the_completions_route_takes_no_images() -> None:
    with pytest.raises(ValueError, match="/inference/v1/generate only"):
        request_body("completions", _request(), "m")


def test_the_replicas_expansion_is_compared_with_the_gateways() -> None:
    req = _request()
    same = {"prompt_token_ids": list(EXPANDED), "mm_placeholders": {"image": _ranges()}}
    found = expansion(same)
    assert found == (list(EXPANDED), [(1, 3), (5, 2)])
    assert expansion_differs(req, *found) is None
    assert expansion({"choices": []}) is None
    longer = [*EXPANDED[:2], 7, *EXPANDED[2:]]
    assert expansion_differs(req, longer, [(1, 4), (6, 2)]) == (
        "9 prompt tokens against the gateway's 8, first apart at 4"
    )
    moved = expansion_differs(req, EXPANDED, [(1, 3), (4, 2)])
    assert moved == "image placeholders [(1, 3), (4, 2)] against the gateway's [(1, 3), (5, 2)]"


def _ranges(offset: int = 5) -> list[dict[str, int]]:
    return [{"offset": 1, "length": 3}, {"offset": offset, "length": 2}]


async def _replica(
    offered: list[str], expanded_at: int, seen: list[dict[str, Any]]
) -> tuple[web.AppRunner, int]:
    """A stand-in for vLLM's server offering ``offered``: its generate route records each
    body in ``seen`` and reports the second image placed at ``expanded_at``."""

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m", "max_model_len": 64}]})

    async def control(_: web.Request) -> web.Response:
        return web.json_response({"result": {"block_size": 16}})

    async def openapi(_: web.Request) -> web.Response:
        return web.json_response({"paths": {p: {} for p in offered}})

    async def generate(request: web.Request) -> web.StreamResponse:
        if request.content_type != "application/json":  # as vLLM's server needs it
            return web.json_response({"error": {"message": "not JSON"}}, status=415)
        body = await request.json()
        seen.append(body)
        choice = {"index": 0, "text": "ok", "token_ids": [5], "finish_reason": "stop"}
        first = {
            "choices": [choice],
            "prompt_token_ids": list(EXPANDED),
            "mm_placeholders": {"image": _ranges(expanded_at)},
        }
        usage = {"prompt_tokens": len(EXPANDED), "prompt_tokens_details": {"cached_tokens": 4}}
        if not body["stream"]:
            return web.json_response(first | {"usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for event in (first, {"choices": [], "usage": usage}):
            await resp.write(f"data: {json.dumps(event)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/vcache/v1/control/{method}", control)
    app.router.add_get("/openapi.json", openapi)
    app.router.add_post(GENERATE, generate)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, port


def _serve(
    demo_model: Path, request: GenerateRequest, offered: list[str], expanded_at: int
) -> tuple[list[GenerateChunk], int, list[dict[str, Any]]]:
    """``request`` through a remote engine on the stand-in: its chunks, the engine's
    expansion mismatches and the bodies the replica was sent."""

    async def main() -> tuple[list[GenerateChunk], int, list[dict[str, Any]]]:
        seen: list[dict[str, Any]] = []
        runner, port = await _replica(offered, expanded_at, seen)
        engine = RemoteVllmEngine(
            RemoteVllmConfig(
                url=f"http://127.0.0.1:{port}", tokenizer=str(demo_model), control_secret="s"
            )
        )
        try:
            await engine.start()
            chunks = [c async for c in engine.generate(request)]
            return chunks, engine.stats().image_expansion_mismatches, seen
        finally:
            await engine.close()
            await runner.cleanup()

    return asyncio.run(main())


@pytest.mark.parametrize("stream", [True, False])
def test_an_image_request_reaches_the_generate_route(demo_model: Path, stream: bool) -> None:
    chunks, mismatches, seen = _serve(demo_model, _request(stream=stream), [GENERATE], 5)
    assert [b["content_parts"] for b in seen] == [content_parts(IMAGES)]
    assert seen[0]["token_ids"] == list(TEMPLATE)
    assert "".join(c.text for c in chunks) == "ok" and chunks[-1].num_cached_tokens == 4
    assert mismatches == 0


@pytest.mark.parametrize("stream", [True, False])
def test_an_expansion_unlike_the_gateways_is_counted(
    demo_model: Path, stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    chunks, mismatches, _ = _serve(demo_model, _request(stream=stream), [GENERATE], 4)
    assert "".join(c.text for c in chunks) == "ok"  # the answer stands
    assert mismatches == 1
    assert "expanded the images of r1 otherwise than the gateway" in caplog.text


def test_a_replica_on_the_completions_route_refuses_images_by_name(demo_model: Path) -> None:
    with pytest.raises(EngineInputError, match=r"image 1 of 2: .* --enable-scale-out") as exc:
        _serve(demo_model, _request(), [], 5)
    assert "/v1/completions" in str(exc.value)


def test_the_gateway_sees_through_remote_replicas_unless_one_is_on_completions(
    tmp_path: Path,
) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["Idefics3ForConditionalGeneration"]}')
    replica = {"url": "http://r:8000", "kv_events": "tcp://r:5557", "control_secret": "s"}

    def vision_model(*apis: str) -> str | None:
        remote = [replica | {"api": a} for a in apis]
        settings = Settings(model=str(tmp_path), engine={"replicas": 0}, remote_replicas=remote)
        return _vision_model(settings)

    assert vision_model("auto", "generate") == str(tmp_path)
    assert vision_model("auto", "completions") is None  # that one takes no images
