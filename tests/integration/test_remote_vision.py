"""Images on a remote replica: vLLM's own OpenAI server (``--enable-scale-out``, the vcache
plugins) serving the demo vision model, behind a gateway with no embedded replica, driven
by the official ``openai`` SDK.  The gateway sends the template's ids and each image's
bytes under its own identifier as the uuid (``engines/vllm/remote_wire.py``): the cached
tokens vLLM reports equal the gateway's prediction through the image's blocks, a client
uuid is honoured as the embedded engine honours it, the replica expands every image to
the gateway's ids (as it reports them back), and an image the gateway refuses is a 400
naming its part before anything reaches the replica; a replica whose model reads text
only refuses an image by name.

Each prompt is also rendered here as vLLM renders it (``VisionRenderer`` over the model's
own tokenizer) to know where the image's placeholders sit."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from PIL import Image

from engines.base import EngineImage, GenerateRequest, SamplingOptions
from engines.errors import EngineInputError
from engines.vllm.demo_vision import ensure_demo_vision_model
from engines.vllm.remote import RemoteVllmConfig, RemoteVllmEngine
from engines.vllm.remote_wire import expansion, expansion_differs, request_body
from gateway.local.vision_prompt import (
    IMAGES_PER_PROMPT,
    PromptImage,
    VisionPrompt,
    VisionRenderer,
)
from tests.integration.conftest import (
    ADMIN,
    ADMIN_KEY,
    ADMIN_KEYS,
    SECRET,
    RemoteVllm,
    _free_port,
    remote_vllm_server,
    running,
)

pytestmark = pytest.mark.integration

MODEL = "demo-vision"
BLOCK = 128  # vLLM's CPU block size
SYSTEM = "You are a careful visual assistant on a remote replica. " * 10
GENERATE = "/inference/v1/generate"


@dataclass(frozen=True)
class RemoteVision:
    url: str
    gateway_log: Path
    vllm: RemoteVllm
    renderer: VisionRenderer
    tokenizer: Any
    closing: contextlib.ExitStack  # the clients handed out, closed with the gateway

    def openai(self) -> openai.OpenAI:
        client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=ADMIN_KEY, max_retries=0)
        return self.closing.enter_context(client)

    def prompt(self, messages: list[dict[str, Any]], images: list[PromptImage]) -> VisionPrompt:
        """``messages`` (each image part as ``{"type": "image"}``) as vLLM expands them."""
        out = self.tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True
        )
        ids = list(out["input_ids"] if hasattr(out, "keys") else out)
        return self.renderer.expand(ids, images)


@pytest.fixture(scope="module")
def remote(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteVision]:
    from transformers import AutoTokenizer

    tmp = tmp_path_factory.mktemp("remote-vision")
    path = str(ensure_demo_vision_model(data_dir))
    extra = ["--max-model-len", "4096", "--limit-mm-per-prompt"]
    extra.append(json.dumps({"image": IMAGES_PER_PROMPT}))
    server, vllm_env, vllm = remote_vllm_server(path, MODEL, tmp, 1 << 28, extra)
    base = {k: v for k, v in os.environ.items() if not k.startswith("VCACHE_")}
    gw_port = _free_port()
    gw_env = base | {
        "VCACHE_REMOTE_REPLICAS": json.dumps([vllm.replica()]),
        "VCACHE_SESSION_LOG__PATH": str(tmp / "sessions.db"),
        # every image request rebuilt from the log and its stored images before it is sent
        "VCACHE_SESSION_LOG__VERIFY_RECONSTRUCTION": "true",
        **ADMIN_KEYS,
    }
    gateway = [
        sys.executable,
        "-m",
        "gateway.cli",
        "serve",
        "--demo",
        "vision",
        "--replicas",
        "0",
        "--port",
        str(gw_port),
        "--grpc-port",
        "0",
        "--data-dir",
        str(data_dir),
    ]
    gw_url = f"http://127.0.0.1:{gw_port}"
    renderer = VisionRenderer.load(path, path, IMAGES_PER_PROMPT)
    assert renderer is not None
    with (
        running(server, vllm_env, f"{vllm.url}/v1/models", vllm.log, "vllm server"),
        running(gateway, gw_env, f"{gw_url}/readyz", tmp / "gateway.log", "gateway"),
        contextlib.ExitStack() as closing,
    ):
        tokenizer = AutoTokenizer.from_pretrained(path)
        yield RemoteVision(gw_url, tmp / "gateway.log", vllm, renderer, tokenizer, closing)


def _image(size: tuple[int, int], color: tuple[int, int, int]) -> PromptImage:
    img = Image.new("RGB", size, color)
    for x in range(0, size[0], 5):
        img.putpixel((x, x % size[1]), (x % 256, 255, 0))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return PromptImage(buf.getvalue(), size[0], size[1])


def _part(img: PromptImage, uuid: str | None = None) -> dict[str, Any]:
    url = f"data:image/png;base64,{base64.b64encode(img.data).decode()}"
    part: dict[str, Any] = {"type": "image_url", "image_url": {"url": url}}
    return part | ({"uuid": uuid} if uuid else {})


def _user(img: PromptImage, text: str, uuid: str | None = None) -> dict[str, Any]:
    return {"role": "user", "content": [_part(img, uuid), {"type": "text", "text": text}]}


def _templated(text: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}


def _chat(r: RemoteVision, messages: list[dict[str, Any]]) -> tuple[int, int, int]:
    """(predicted cached tokens, vLLM's cached tokens, prompt tokens) of one chat call,
    served by the remote replica."""
    raw = r.openai().chat.completions.with_raw_response.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=2,
    )
    assert raw.headers["x-vcache-replica"] == "remote-0"
    out = raw.parse()
    assert out.usage is not None and out.usage.prompt_tokens_details is not None
    cached = int(out.usage.prompt_tokens_details.cached_tokens or 0)
    return int(raw.headers["x-vcache-predicted-cached-tokens"]), cached, out.usage.prompt_tokens


def _through(cached: int, vp: VisionPrompt) -> bool:
    """Whether ``cached`` tokens reach every full block of the prompt's first image."""
    span = vp.spans[0]
    return cached >= (span.offset + span.length) // BLOCK * BLOCK > span.offset


def test_the_replica_agrees_on_block_hashes(remote: RemoteVision) -> None:
    stats = httpx.get(f"{remote.url}/v1/cache/stats", headers=ADMIN, timeout=30).json()
    assert stats["replicas"]["remote-0"]["hash_agreement"] == "exact"


def test_same_system_and_image_another_question_hits_through_the_image(
    remote: RemoteVision,
) -> None:
    shot = _image((640, 400), (20, 40, 200))
    system = {"role": "system", "content": SYSTEM}
    sent = remote.vllm.routes(GENERATE)
    predicted, cached, n = _chat(remote, [system, _user(shot, "What is it?")])
    assert predicted == cached == 0
    assert n == len(remote.prompt([system, _templated("What is it?")], [shot]).token_ids)
    predicted, cached, n = _chat(remote, [system, _user(shot, "Which colour dominates?")])
    second = remote.prompt([system, _templated("Which colour dominates?")], [shot])
    print(f"\nremote, 640x400 image: {n} tokens, {cached} cached, {predicted} predicted")
    assert n == len(second.token_ids)  # the replica expanded the image as the gateway did
    assert predicted == cached
    assert _through(cached, second)
    assert remote.vllm.routes(GENERATE) - sent == 2  # both went to the generate route


def test_two_images_under_one_client_uuid_share_their_blocks(remote: RemoteVision) -> None:
    """The client's uuid is the image's identity on a remote replica as on the embedded
    engine: another image sent under it hits the first one's blocks, predicted exactly;
    the same image without it is its own."""
    system = {"role": "system", "content": SYSTEM + "Named. "}
    red = _image((320, 240), (210, 10, 10))
    blue = _image((320, 240), (10, 10, 210))
    first, read, _ = _chat(remote, [system, _user(red, "Colour?", "h50-remote-shot")])
    expected = remote.prompt([system, _templated("Colour?")], [blue])
    assert first == read < expected.spans[0].offset  # nothing of the image yet
    predicted, cached, n = _chat(remote, [system, _user(blue, "Colour?", "h50-remote-shot")])
    assert n == len(expected.token_ids)
    assert predicted == cached
    assert _through(cached, expected)
    predicted, cached, _ = _chat(remote, [system, _user(blue, "Colour!")])
    assert predicted == cached <= expected.spans[0].offset


def test_the_image_moved_one_message_later_is_not_hit_past_the_move(remote: RemoteVision) -> None:
    shot = _image((320, 240), (200, 30, 60))
    system = {"role": "system", "content": SYSTEM + "Moved. "}
    _chat(remote, [system, _user(shot, "Describe.")])
    aside = {"role": "user", "content": "One more thing first."}
    predicted, cached, _ = _chat(remote, [system, aside, _user(shot, "Describe.")])
    assert predicted == cached
    moved = remote.prompt([system, aside, _templated("Describe.")], [shot])
    assert predicted < moved.spans[0].offset


def test_one_image_too_many_is_a_400_before_anything_is_sent(remote: RemoteVision) -> None:
    shot = _image((64, 64), (1, 2, 3))
    parts = [_part(shot) for _ in range(IMAGES_PER_PROMPT + 1)]
    sent = remote.vllm.routes(GENERATE)
    with pytest.raises(openai.BadRequestError) as err:
        remote.openai().chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": [*parts, {"type": "text", "text": "hi"}]}],  # type: ignore[list-item,misc]
            max_tokens=1,
        )
    assert err.value.status_code == 400
    assert f"messages[0].content[{IMAGES_PER_PROMPT}]" in str(err.value)
    assert remote.vllm.routes(GENERATE) == sent


def test_an_image_conversation_through_the_messages_api_predicted_exactly(
    remote: RemoteVision,
) -> None:
    shot = _image((320, 240), (90, 160, 30))
    image = {
        "type": "image",
        "source": {
            "type": "base64",
            "media_type": "image/png",
            "data": base64.b64encode(shot.data).decode(),
        },
    }
    history: list[dict[str, Any]] = [
        {"role": "user", "content": [image, {"type": "text", "text": "What do you see?"}]}
    ]
    client = anthropic.Anthropic(base_url=remote.url, api_key=ADMIN_KEY, max_retries=0)
    reads = []
    for turn in range(3):
        raw = client.messages.with_raw_response.create(
            model=MODEL,
            max_tokens=4,
            system=SYSTEM + "Messages. ",
            messages=history,  # type: ignore[arg-type]
        )
        assert raw.headers["x-vcache-replica"] == "remote-0"
        m = raw.parse()
        read = m.usage.cache_read_input_tokens or 0
        assert int(raw.headers["x-vcache-predicted-cached-tokens"]) == read, (turn, m.usage)
        reads.append(read)
        text = "".join(b.text for b in m.content if b.type == "text") or "..."
        history += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": f"And then, turn {turn}?"},
        ]
    system = {"role": "system", "content": SYSTEM + "Messages. "}
    offset = remote.prompt([system, _templated("What do you see?")], [shot]).spans[0].offset
    assert all(r > offset for r in reads[1:]), reads  # each later turn reads through the image


def test_prompt_logprobs_of_an_image_prompt_come_whole(remote: RemoteVision) -> None:
    """Prompt logprobs are asked of the replica as a whole answer (not a stream): an image
    request takes that path too, one logprob entry per token of the prompt as the gateway
    expanded it.  (vLLM reads no cache for a request with prompt logprobs:
    ``SamplingParams.skip_reading_prefix_cache``.)"""
    shot = _image((200, 900), (70, 70, 160))
    system = {"role": "system", "content": SYSTEM + "Whole. "}
    expected = remote.prompt([system, _templated("Tall?")], [shot])
    for _ in range(2):  # the second time its blocks (and the shared system's) are resident
        raw = remote.openai().chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[system, _user(shot, "Tall?")],  # type: ignore[list-item]
            max_tokens=1,
            extra_body={"prompt_logprobs": 1},
        )
        assert raw.headers["x-vcache-replica"] == "remote-0"
        out = raw.parse()
        assert out.usage is not None and out.usage.prompt_tokens == len(expected.token_ids)
        steps = (out.model_extra or {}).get("prompt_logprobs")
        assert steps is not None and len(steps) == len(expected.token_ids)
        assert out.usage.prompt_tokens_details is not None
        assert not out.usage.prompt_tokens_details.cached_tokens
        # and the gateway knows it: predicted 0, exact (it predicted 128, then 256)
        assert raw.headers["x-vcache-predicted-cached-tokens"] == "0"
        assert raw.headers["x-vcache-prediction"] == "exact"


def test_the_replica_expands_the_wires_images_to_the_gateways_ids(remote: RemoteVision) -> None:
    """The body the gateway sends (``request_body``), posted to the replica here: the ids
    and placeholders it reports back are the gateway's expansion, and the gateway's log
    records no replica expanding otherwise."""
    system = {"role": "system", "content": SYSTEM + "Wire. "}
    images = [_image((90, 500), (5, 5, 5)), _image((500, 90), (9, 9, 9))]
    user = {
        "role": "user",
        "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Two?"}],
    }
    out = remote.tokenizer.apply_chat_template(
        [system, user], tokenize=True, add_generation_prompt=True
    )
    template = tuple(out["input_ids"] if hasattr(out, "keys") else out)
    vp = remote.renderer.expand(template, images)
    req = GenerateRequest(
        request_id="h50-wire",
        prompt_token_ids=vp.token_ids,
        sampling=SamplingOptions(max_tokens=1),
        images=tuple(
            EngineImage(i.data, "image/png", s.identifier, None, s.offset, s.length)
            for i, s in zip(images, vp.spans, strict=True)
        ),
        template_token_ids=template,
    )
    body = request_body("generate", req, MODEL) | {"stream": False}
    body.pop("stream_options")
    r = httpx.post(f"{remote.vllm.url}{GENERATE}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    found = expansion(r.json())
    assert found is not None
    assert found == (list(vp.token_ids), [(s.offset, s.length) for s in vp.spans])
    assert expansion_differs(req, *found) is None
    assert "otherwise than the gateway" not in remote.gateway_log.read_text(errors="replace")


def test_a_replica_whose_model_reads_text_only_refuses_an_image_by_name(
    remote_vllm: RemoteVllm, demo_model: Path
) -> None:
    """The session's text-model replica (vLLM's server on the text demo, with the generate
    route) handed an image request by a remote engine: vLLM's 400 naming the model, an
    input error (the gateway's 400), not an engine failure."""
    shot = _image((64, 64), (3, 2, 1))
    request = GenerateRequest(
        request_id="h50-text-only",
        prompt_token_ids=(1, 5, 5, 2),
        sampling=SamplingOptions(max_tokens=1),
        images=(EngineImage(shot.data, "image/png", "x", None, 1, 2),),
        template_token_ids=(1, 5, 2),
    )

    async def main() -> None:
        config = RemoteVllmConfig(
            url=remote_vllm.url, tokenizer=str(demo_model), control_secret=SECRET
        )
        engine = RemoteVllmEngine(config)
        try:
            await engine.start()
            assert engine.api == "generate"
            async for _ in engine.generate(request):
                pass
        finally:
            await engine.close()

    with pytest.raises(EngineInputError, match="is not a multimodal model"):
        asyncio.run(main())
