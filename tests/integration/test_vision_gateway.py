"""Image requests through the gateway on the demo vision model (`vcache serve --demo
vision`, one vLLM CPU replica shared by the module), driven by the official ``openai`` and
``anthropic`` SDKs: the gateway's ``x-vcache-predicted-cached-tokens`` equals the cached
tokens vLLM reports, through an image's blocks and not past an image that moved; an image
the processor cannot take (one too many) is a 400 naming its part.

Each prompt is also rendered here as vLLM renders it (``VisionRenderer`` over the model's
own tokenizer) to know where the image's placeholders sit."""

from __future__ import annotations

import base64
import io
import os
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from PIL import Image

from engines.vllm.demo_vision import ensure_demo_vision_model
from gateway.local.vision_prompt import (
    IMAGES_PER_PROMPT,
    PromptImage,
    VisionPrompt,
    VisionRenderer,
)
from tests.integration.conftest import running

pytestmark = pytest.mark.integration

MODEL = "demo-vision"
BLOCK = 128  # vLLM's CPU block size
SYSTEM = "You are a careful visual assistant. " * 12


@dataclass(frozen=True)
class Vision:
    url: str
    renderer: VisionRenderer
    tokenizer: Any

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    def anthropic(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.url, api_key="unused", max_retries=0)

    def prompt(self, messages: list[dict[str, Any]], images: list[PromptImage]) -> VisionPrompt:
        """``messages`` (each image part as ``{"type": "image"}``) as vLLM expands them."""
        out = self.tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True
        )
        ids = list(out["input_ids"] if hasattr(out, "keys") else out)
        return self.renderer.expand(ids, images)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def vision(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Vision]:
    from transformers import AutoTokenizer

    tmp = tmp_path_factory.mktemp("vision")
    path = str(ensure_demo_vision_model(data_dir))
    port = _port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("VCACHE_")}
    env["VCACHE_SESSION_LOG__PATH"] = str(tmp / "sessions.db")
    # every image request rebuilt from the log and its stored images before it is sent
    env["VCACHE_SESSION_LOG__VERIFY_RECONSTRUCTION"] = "true"
    cmd = [
        sys.executable,
        "-m",
        "gateway.cli",
        "serve",
        "--demo",
        "vision",
        "--port",
        str(port),
        "--grpc-port",
        "0",
        "--data-dir",
        str(data_dir),
        "--enforce-eager",
        "--replicas",
        "1",
        "--kv-cache-bytes",
        str(1 << 29),
        "--max-model-len",
        "4096",
    ]
    url = f"http://127.0.0.1:{port}"
    renderer = VisionRenderer.load(path, path, IMAGES_PER_PROMPT)
    assert renderer is not None
    with running(cmd, env, f"{url}/readyz", tmp / "gateway.log", "gateway"):
        yield Vision(url, renderer, AutoTokenizer.from_pretrained(path))


def _image(size: tuple[int, int], fmt: str, color: tuple[int, int, int]) -> PromptImage:
    img = Image.new("RGB", size, color)
    for x in range(0, size[0], 5):
        img.putpixel((x, x % size[1]), (x % 256, 255, 0))
    buf = io.BytesIO()
    img.save(buf, fmt)
    return PromptImage(buf.getvalue(), size[0], size[1])


def _url(img: PromptImage, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(img.data).decode()}"


def _chat(v: Vision, messages: list[dict[str, Any]]) -> tuple[int, int, int]:
    """(predicted cached tokens, vLLM's cached tokens, prompt tokens) of one chat call."""
    raw = v.openai().chat.completions.with_raw_response.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=1,
    )
    r = raw.parse()
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    cached = int(r.usage.prompt_tokens_details.cached_tokens or 0)
    return int(raw.headers["x-vcache-predicted-cached-tokens"]), cached, r.usage.prompt_tokens


def _user(img: PromptImage, text: str) -> dict[str, Any]:
    return {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": _url(img)}},
            {"type": "text", "text": text},
        ],
    }


def _templated(img_first: bool, text: str) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "image"}, {"type": "text", "text": text}]
    return {"role": "user", "content": parts if img_first else parts[::-1]}


def test_same_system_and_image_another_question_hits_through_the_image(vision: Vision) -> None:
    shot = _image((640, 400), "PNG", (20, 40, 200))
    system = {"role": "system", "content": SYSTEM}
    t0 = time.perf_counter()
    predicted, cached, n = _chat(vision, [system, _user(shot, "What is it?")])
    cold = time.perf_counter() - t0
    assert predicted == cached == 0
    expected = vision.prompt([system, _templated(True, "What is it?")], [shot])
    assert n == len(expected.token_ids)  # the gateway counts the image as vLLM expands it
    t0 = time.perf_counter()
    predicted, cached, n = _chat(vision, [system, _user(shot, "Which colour dominates?")])
    print(
        f"\n640x400 image through the gateway: {n} tokens, cold {cold:.3f} s, warm "
        f"{time.perf_counter() - t0:.3f} s ({cached} cached)"
    )
    second = vision.prompt([system, _templated(True, "Which colour dominates?")], [shot])
    assert n == len(second.token_ids)
    assert predicted == cached
    span = second.spans[0]
    assert cached >= (span.offset + span.length) // BLOCK * BLOCK > span.offset  # its blocks


def test_the_image_moved_one_message_later_is_not_hit_past_the_move(vision: Vision) -> None:
    shot = _image((320, 240), "PNG", (200, 30, 60))
    system = {"role": "system", "content": SYSTEM + "Moved. "}
    _chat(vision, [system, _user(shot, "Describe.")])
    later = [system, {"role": "user", "content": "One more thing first."}, _user(shot, "Describe.")]
    predicted, cached, _ = _chat(vision, later)
    assert predicted == cached
    before = vision.prompt([system, _templated(True, "Describe.")], [shot])
    moved = vision.prompt(
        [
            system,
            {"role": "user", "content": "One more thing first."},
            _templated(True, "Describe."),
        ],
        [shot],
    )
    first_diff = next(
        i for i, (a, b) in enumerate(zip(before.token_ids, moved.token_ids, strict=False)) if a != b
    )
    assert predicted == first_diff // BLOCK * BLOCK
    assert predicted < moved.spans[0].offset


def test_one_image_too_many_is_a_400_naming_it(vision: Vision) -> None:
    shot = _image((64, 64), "PNG", (1, 2, 3))
    parts: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": _url(shot)}}
        for _ in range(IMAGES_PER_PROMPT + 1)
    ]
    with pytest.raises(openai.BadRequestError) as err:
        vision.openai().chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": [*parts, {"type": "text", "text": "hi"}]}],  # type: ignore[list-item,misc]
            max_tokens=1,
        )
    where = f"messages[0].content[{IMAGES_PER_PROMPT}]"
    assert err.value.status_code == 400
    assert where in str(err.value)


def test_an_image_conversation_through_the_messages_api_predicted_exactly(
    vision: Vision,
) -> None:
    shot = _image((320, 240), "PNG", (90, 160, 30))
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
    client = vision.anthropic()
    reads = []
    for turn in range(4):
        raw = client.messages.with_raw_response.create(
            model=MODEL,
            max_tokens=4,
            system=SYSTEM + "Messages. ",
            messages=history,  # type: ignore[arg-type]
        )
        m = raw.parse()
        read = m.usage.cache_read_input_tokens or 0
        assert int(raw.headers["x-vcache-predicted-cached-tokens"]) == read, (turn, m.usage)
        reads.append(read)
        text = "".join(b.text for b in m.content if b.type == "text") or "..."
        history += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": f"And then, turn {turn}?"},
        ]
    assert all(r > 0 for r in reads[1:]), reads  # each later turn reads through the image
    assert reads == sorted(reads), reads
