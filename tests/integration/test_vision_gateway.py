"""Image requests through the gateway on the demo vision model (`vcache serve --demo
vision`, one vLLM CPU replica shared by the module), driven by the official ``openai`` and
``anthropic`` SDKs: the gateway's ``x-vcache-predicted-cached-tokens`` equals the cached
tokens vLLM reports, through an image's blocks and not past an image that moved; an image
the processor cannot take (one too many) is a 400 naming its part; ``/tokenize`` and the
cache API (lookup, pin, warm) name an image-bearing prompt's blocks as the chat hashes them.

Each prompt is also rendered here as vLLM renders it (``VisionRenderer`` over the model's
own tokenizer) to know where the image's placeholders sit."""

from __future__ import annotations

import base64
import contextlib
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
import grpc
import httpx
import openai
import pytest
from PIL import Image

from engines.vllm.demo_vision import ensure_demo_vision_model
from gateway.grpc.api import gateway_pb2 as pb
from gateway.grpc.api import gateway_pb2_grpc as pb_grpc
from gateway.local.vision_prompt import (
    IMAGES_PER_PROMPT,
    PromptImage,
    VisionPrompt,
    VisionRenderer,
)
from tests.integration.conftest import ADMIN, ADMIN_KEY, ADMIN_KEYS, running

pytestmark = pytest.mark.integration

MODEL = "demo-vision"
BLOCK = 128  # vLLM's CPU block size
SYSTEM = "You are a careful visual assistant. " * 12


@dataclass(frozen=True)
class Vision:
    url: str
    grpc_port: int
    renderer: VisionRenderer
    tokenizer: Any
    closing: contextlib.ExitStack  # the clients handed out, closed with the gateway

    def openai(self) -> openai.OpenAI:
        client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=ADMIN_KEY, max_retries=0)
        return self.closing.enter_context(client)

    def anthropic(self) -> anthropic.Anthropic:
        client = anthropic.Anthropic(base_url=self.url, api_key=ADMIN_KEY, max_retries=0)
        return self.closing.enter_context(client)

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """An admin's call to the gateway's own API; its 200 answer."""
        r = httpx.post(f"{self.url}{path}", json=body, headers=ADMIN, timeout=120)
        assert r.status_code == 200, r.text
        return dict(r.json())

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
    grpc_port = _port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("VCACHE_")}
    env["VCACHE_SESSION_LOG__PATH"] = str(tmp / "sessions.db")
    # every image request rebuilt from the log and its stored images before it is sent
    env["VCACHE_SESSION_LOG__VERIFY_RECONSTRUCTION"] = "true"
    env |= ADMIN_KEYS  # the cache API's admin; every client sends the key
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
        str(grpc_port),
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
    tokenizer = AutoTokenizer.from_pretrained(path)
    with (
        running(cmd, env, f"{url}/readyz", tmp / "gateway.log", "gateway"),
        contextlib.ExitStack() as closing,
    ):
        yield Vision(url, grpc_port, renderer, tokenizer, closing)


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


def _encoded(mode: str, size: tuple[int, int], fmt: str, **kw: Any) -> PromptImage:
    img = Image.new(mode, size)
    for x in range(size[0]):
        img.putpixel((x, x % size[1]), 255 if mode in ("L", "1", "I;16") else (255,) * len(mode))
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return PromptImage(buf.getvalue(), size[0], size[1])


def _animated_gif() -> PromptImage:
    frames = [Image.new("P", (90, 60), c) for c in (1, 80, 160)]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    return PromptImage(buf.getvalue(), 90, 60)


# images the demo model's processor takes although they are odd: a pixel, a line, an
# extreme aspect ratio, and the modes and formats vLLM converts to RGB itself
ODD = {
    "1x1 png": (lambda: _encoded("RGB", (1, 1), "PNG"), "image/png"),
    "3x1 png": (lambda: _encoded("RGB", (3, 1), "PNG"), "image/png"),
    "5000x3 png": (lambda: _encoded("RGB", (5000, 3), "PNG"), "image/png"),
    "grey+alpha png": (lambda: _encoded("LA", (50, 70), "PNG"), "image/png"),
    "16-bit grey png": (lambda: _encoded("I;16", (64, 48), "PNG"), "image/png"),
    "cmyk jpeg": (lambda: _encoded("CMYK", (120, 80), "JPEG"), "image/jpeg"),
    "animated gif": (_animated_gif, "image/gif"),
    "rgba webp": (lambda: _encoded("RGBA", (100, 100), "WEBP", lossless=True), "image/webp"),
}


@pytest.mark.parametrize("name", list(ODD))
def test_an_odd_image_the_processor_takes_is_served_and_predicted_exactly(
    vision: Vision, name: str
) -> None:
    """Never an engine error: the image is served, counted as vLLM expands it, and a
    second question reads through its blocks as predicted."""
    make, media = ODD[name]
    shot = make()
    system = {"role": "system", "content": SYSTEM + f"Odd: {name}. "}
    user = {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": _url(shot, media)}},
            {"type": "text", "text": "What is it?"},
        ],
    }
    predicted, cached, n = _chat(vision, [system, user])
    expected = vision.prompt([system, _templated(True, "What is it?")], [shot])
    assert n == len(expected.token_ids)
    assert predicted == cached
    again = {**user, "content": [user["content"][0], {"type": "text", "text": "And now?"}]}
    predicted, cached, n = _chat(vision, [system, again])
    span = vision.prompt([system, _templated(True, "And now?")], [shot]).spans[0]
    assert predicted == cached >= (span.offset + span.length) // BLOCK * BLOCK > 0


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _bmp() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (40, 30)).save(buf, "BMP")
    return buf.getvalue()


PNG = _encoded("RGB", (64, 64), "PNG").data
REFUSED = {  # (the bytes, the media type the client declares, what the 400 says)
    "a bmp called png": (_bmp(), "image/png", "not image/png"),
    "a png called jpeg": (PNG, "image/jpeg", "the bytes are image/png, not image/jpeg"),
    "a truncated png": (PNG[: len(PNG) // 2], "image/png", "does not decode"),
    "a png whose header lies": (
        PNG[:16] + (5000).to_bytes(4, "big") + PNG[20:],
        "image/png",
        "does not decode",
    ),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_an_image_no_decoder_takes_is_a_400_naming_the_clients_part(
    vision: Vision, name: str
) -> None:
    """Through the Messages API: the client's own name of the block, never an engine
    error (the image is refused before anything is rendered or sent)."""
    data, media, says = REFUSED[name]
    good = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": _b64(PNG)},
    }
    bad = {"type": "image", "source": {"type": "base64", "media_type": media, "data": _b64(data)}}
    history: Any = [
        {"role": "user", "content": [good, {"type": "text", "text": "Look."}]},
        {"role": "assistant", "content": "Looked."},
        {"role": "user", "content": [{"type": "text", "text": "And this?"}, bad]},
    ]
    with pytest.raises(anthropic.BadRequestError) as err:
        vision.anthropic().messages.create(model=MODEL, max_tokens=1, messages=history)
    assert err.value.status_code == 400
    assert "messages.2.content.1" in str(err.value) and says in str(err.value), err.value


def test_a_conversations_fifth_screenshot_in_a_tool_result_is_a_400_naming_it(
    vision: Vision,
) -> None:
    """An agent's screenshots accumulate: the one past the model's limit, in a tool
    result, is named as the client sent it."""
    tool: Any = {"name": "computer", "input_schema": {"type": "object", "properties": {}}}
    history: Any = [{"role": "user", "content": "Start."}]
    for i in range(IMAGES_PER_PROMPT + 1):
        shot = _image((64 + i, 64), "PNG", (i, 2, 3))
        history += [
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": f"toolu_{i}", "name": "computer", "input": {}}
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": f"toolu_{i}",
                        "content": [
                            {"type": "text", "text": f"screenshot {i}"},
                            {
                                "type": "image",
                                "source": {
                                    "type": "base64",
                                    "media_type": "image/png",
                                    "data": _b64(shot.data),
                                },
                            },
                        ],
                    }
                ],
            },
        ]
    with pytest.raises(anthropic.BadRequestError) as err:
        vision.anthropic().messages.create(
            model=MODEL, max_tokens=1, tools=[tool], messages=history
        )
    last = 2 * IMAGES_PER_PROMPT + 2
    assert f"messages.{last}.content.0.content.1" in str(err.value), err.value


def _spans_of(v: Vision, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The cache API's lookup of ``messages`` on the one replica."""
    found = v.post("/v1/cache/lookup", {"model": MODEL, "messages": messages})
    return dict(found["replicas"][0])


def test_tokenize_and_lookup_name_an_image_prompts_blocks_as_the_chat_hashes_them(
    vision: Vision,
) -> None:
    shot = _image((480, 300), "PNG", (10, 200, 90))
    system = {"role": "system", "content": "Tokenize. " + SYSTEM}
    messages = [system, _user(shot, "What is it?")]
    expected = vision.prompt([system, _templated(True, "What is it?")], [shot])
    got = vision.post("/tokenize", {"model": MODEL, "messages": messages})
    assert got["tokens"] == list(expected.token_ids)  # the image expanded as vLLM does
    assert len(got["block_hashes"]) == len(expected.token_ids) // BLOCK
    before = _spans_of(vision, messages)
    assert before["block_hashes"] == got["block_hashes"] and not any(before["resident"])
    _chat(vision, messages)
    after = _spans_of(vision, messages)  # the engine's KV events keyed them so
    assert all(after["resident"]), after["resident"]
    predicted, cached, n = _chat(vision, messages)
    assert after["predicted_cached_tokens"] == predicted == cached == (n - 1) // BLOCK * BLOCK


def test_a_warm_and_a_pin_of_an_image_prompt_hold_its_image_blocks(vision: Vision) -> None:
    shot = _image((300, 500), "PNG", (240, 200, 10))
    system = {"role": "system", "content": "Warm. " + SYSTEM}
    messages = [system, _user(shot, "Describe it.")]
    n = len(vision.prompt([system, _templated(True, "Describe it.")], [shot]).token_ids)
    warmed = vision.post("/v1/cache/warm", {"model": MODEL, "messages": messages})
    assert warmed["cached_tokens_before"] == 0
    assert warmed["cached_tokens_after"] == n // BLOCK * BLOCK  # through the image
    pinned = vision.post("/v1/cache/pin", {"model": MODEL, "messages": messages, "lease_s": 60})
    (held,) = pinned["replicas"]
    assert len(held["pinned"]) == n // BLOCK and held["missing"] == [] == held["refused"]
    predicted, cached, _ = _chat(vision, messages)
    assert predicted == cached == (n - 1) // BLOCK * BLOCK  # vLLM computes the last token
    out = vision.post("/v1/cache/unpin", {"model": MODEL, "messages": messages})
    assert len(out["replicas"][0]["unpinned"]) == n // BLOCK


def test_tokenize_refuses_a_bad_image_by_its_part(vision: Vision) -> None:
    bad = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{_b64(_bmp())}"}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}, bad]}]
    r = httpx.post(
        f"{vision.url}/tokenize", json={"model": MODEL, "messages": messages}, headers=ADMIN
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages[0].content[1]", r.text


def test_count_tokens_counts_an_image_as_the_next_request_does(vision: Vision) -> None:
    shot = _image((500, 300), "PNG", (5, 90, 250))
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": _b64(shot.data)},
    }
    history: Any = [{"role": "user", "content": [{"type": "text", "text": "See:"}, image]}]
    client = vision.anthropic()
    system = "Count. " + SYSTEM
    counted = client.messages.count_tokens(model=MODEL, system=system, messages=history)
    m = client.messages.create(model=MODEL, max_tokens=1, system=system, messages=history)
    u = m.usage
    sent = u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0)
    assert counted.input_tokens == sent
    expected = vision.prompt(
        [
            {"role": "system", "content": system},
            {"role": "user", "content": [{"type": "text", "text": "See:"}, {"type": "image"}]},
        ],
        [shot],
    )
    assert sent == len(expected.token_ids)  # the image as vLLM expands it


def _exif_jpeg(size: tuple[int, int], color: tuple[int, int, int], orientation: int) -> bytes:
    """A JPEG stored at ``size`` whose EXIF orientation tag says how to show it."""
    img = Image.new("RGB", size, color)
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    img.save(buf, "JPEG", exif=exif.tobytes())
    return buf.getvalue()


def test_a_jpeg_marked_rotated_is_counted_upright_and_predicted_exactly(vision: Vision) -> None:
    """vLLM's server turns an image upright by its EXIF orientation before its processor
    sees it: a 1600 x 200 JPEG marked "rotate 90" (orientation 6) is a 200 x 1600 image
    (4 rows of one tile, not one row of 4), in the gateway's count and in the engine's."""
    marked = PromptImage(_exif_jpeg((1600, 200), (200, 120, 30), 6), 1600, 200)
    system = {"role": "system", "content": SYSTEM + "Upright. "}

    def user(text: str) -> dict[str, Any]:
        url = _url(marked, "image/jpeg")
        return {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": text},
            ],
        }

    predicted, cached, n = _chat(vision, [system, user("What is it?")])
    assert predicted == cached  # the system prompt's first block is other tests' too
    upright = _image((200, 1600), "JPEG", (200, 120, 30))
    as_shown = vision.prompt([system, _templated(True, "What is it?")], [upright])
    as_stored = vision.prompt(
        [system, _templated(True, "What is it?")], [_image((1600, 200), "JPEG", (200, 120, 30))]
    )
    assert n == len(as_shown.token_ids) == len(as_stored.token_ids) + 3  # a newline per row
    predicted, cached, n = _chat(vision, [system, user("Which way up?")])
    assert predicted == cached
    span = vision.prompt([system, _templated(True, "Which way up?")], [upright]).spans[0]
    assert cached >= (span.offset + span.length) // BLOCK * BLOCK > span.offset


def expected_offset(v: Vision, system: dict[str, Any], img: PromptImage) -> int:
    """Where the image's placeholders start in ``system`` + the image + a question."""
    return v.prompt([system, _templated(True, "Colour?")], [img]).spans[0].offset


def test_two_images_under_one_client_uuid_share_their_blocks(vision: Vision) -> None:
    """vLLM's extension, honoured as vLLM honours it: an ``image_url`` part's ``uuid`` is
    the image's identity, so another image sent under the same uuid hits the first one's
    blocks (the client asserted they are one image), predicted exactly."""
    system = {"role": "system", "content": SYSTEM + "Named. "}

    def user(img: PromptImage, text: str) -> dict[str, Any]:
        part = {"type": "image_url", "image_url": {"url": _url(img)}, "uuid": "h50b-shot-1"}
        return {"role": "user", "content": [part, {"type": "text", "text": text}]}

    red = _image((320, 240), "PNG", (210, 10, 10))
    blue = _image((320, 240), "PNG", (10, 10, 210))
    first, read, _ = _chat(vision, [system, user(red, "Colour?")])
    assert first == read < expected_offset(vision, system, red)  # nothing of the image yet
    predicted, cached, n = _chat(vision, [system, user(blue, "Colour?")])
    expected = vision.prompt([system, _templated(True, "Colour?")], [blue])
    assert n == len(expected.token_ids)
    assert predicted == cached
    span = expected.spans[0]
    assert cached >= (span.offset + span.length) // BLOCK * BLOCK > span.offset  # through it
    # without the uuid the blue image is its own: nothing past the text before it is hit
    plain = {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": _url(blue)}},
            {"type": "text", "text": "Colour!"},
        ],
    }
    predicted, cached, _ = _chat(vision, [system, plain])
    assert predicted == cached <= span.offset


def test_grpc_images_under_one_uuid_share_their_blocks(vision: Vision) -> None:
    """The gRPC API's ``Image.uuid`` is the image's identity as chat's ``uuid`` is: two
    images sent under one uuid share their KV blocks, predicted exactly; without it the
    second image is its own."""
    system = pb.ChatMessage(role="system", content=SYSTEM + "Over gRPC. ")
    red = _image((320, 240), "PNG", (200, 30, 30))
    blue = _image((320, 240), "PNG", (30, 30, 200))

    def ask(img: PromptImage, uuid: str, text: str) -> tuple[int, int]:
        image = pb.Image(data=img.data, media_type="image/png", uuid=uuid)
        parts = [pb.ContentPart(image=image), pb.ContentPart(text=text)]
        request = pb.ChatCompletionRequest(
            model=MODEL,
            messages=[system, pb.ChatMessage(role="user", parts=parts)],
            sampling=pb.SamplingParams(max_tokens=1),
        )
        with grpc.insecure_channel(f"127.0.0.1:{vision.grpc_port}") as channel:
            r = pb_grpc.GatewayStub(channel).ChatCompletion(
                request, metadata=(("authorization", f"Bearer {ADMIN_KEY}"),), timeout=120
            )
        assert r.usage.HasField("predicted_cached_tokens")
        return r.usage.predicted_cached_tokens, r.usage.cached_tokens

    templated = {"role": "system", "content": SYSTEM + "Over gRPC. "}
    span = vision.prompt([templated, _templated(True, "Colour?")], [blue]).spans[0]
    predicted, cached = ask(red, "grpc-shot-1", "Colour?")
    assert predicted == cached <= span.offset  # nothing of the image yet
    predicted, cached = ask(blue, "grpc-shot-1", "Colour?")
    assert predicted == cached >= (span.offset + span.length) // BLOCK * BLOCK > span.offset
    predicted, cached = ask(blue, "", "Colour!")  # no uuid: the blue bytes are a new image
    assert predicted == cached <= span.offset
