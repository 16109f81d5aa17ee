"""The provider emulator's images: each provider's token rule, the bytes it received, and
its cache, which reads an image-bearing prefix only when the image is identical."""

from __future__ import annotations

import base64
import hashlib
import io
from typing import Any

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from loadtests.emulator.app import create_app
from loadtests.emulator.media import anthropic_tokens, gemini_tokens, openai_tokens
from loadtests.emulator.state import EmulatorState, Piece, TokenStream, prefix_keys, tokens

A = {"x-api-key": "k", "anthropic-version": "2023-06-01"}
B = {"authorization": "Bearer k"}
G = {"x-goog-api-key": "k"}
LONG = "Policy line that stays the same across requests.\n" * 120  # ~1500 tokens


def png(w: int, h: int, color: tuple[int, int, int] = (200, 10, 10)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (w, h), color).save(out, format="PNG")
    return out.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture
def emu() -> TestClient:
    return TestClient(create_app(EmulatorState(shards=1, capacity=64)))


@pytest.mark.parametrize(
    ("w", "h", "want"),
    [
        (200, 200, 54),  # ceil(40000 / 750)
        (1000, 1000, 1334),  # under both limits: ceil(1e6 / 750)
        (3000, 1500, 1600),  # long edge to 1568, then about 1.15 megapixels
    ],
)
def test_anthropic_rule(w: int, h: int, want: int) -> None:
    assert anthropic_tokens(w, h) == pytest.approx(want, abs=1)


@pytest.mark.parametrize(
    ("w", "h", "detail", "want"),
    [
        (4096, 8192, "low", 85),
        (1024, 1024, "high", 765),  # 768 x 768: 4 tiles
        (2048, 4096, "high", 1105),  # 1024 x 2048, then 768 x 1536: 6 tiles
        (500, 500, "auto", 255),  # one tile
        (513, 500, None, 425),  # two tiles
    ],
)
def test_openai_tile_rule(w: int, h: int, detail: str | None, want: int) -> None:
    assert openai_tokens(w, h, detail) == want


def test_gemini_rule() -> None:
    assert gemini_tokens(384, 300) == 258
    assert gemini_tokens(1600, 900) == 258 * 3 * 2


def test_text_only_stream_counts_and_keys_as_before() -> None:
    data = b"tool:{}\nmsg:" + b"x" * 5001 + b"\n"
    stream = TokenStream([Piece(data[:8]), Piece(data[8:])])
    assert stream.total == tokens(data)
    cuts = [1024, 1152]
    assert stream.keys(b"m\0", cuts) == prefix_keys(b"m\0", data, cuts)


def anthropic_body(image: bytes, question: str) -> dict[str, Any]:
    source = {"type": "base64", "media_type": "image/png", "data": b64(image)}
    content = [
        {"type": "text", "text": LONG},
        {"type": "image", "source": source, "cache_control": {"type": "ephemeral"}},
    ]
    return {
        "model": "claude-sonnet-4-5",
        "max_tokens": 4,
        "messages": [
            {"role": "user", "content": content},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": question},
        ],
    }


def test_anthropic_counts_the_image_and_caches_only_identical_bytes(emu: TestClient) -> None:
    red, black = png(300, 200), png(300, 200, (0, 0, 0))
    first = emu.post("/v1/messages", headers=A, json=anthropic_body(red, "q1")).json()["usage"]
    written = first["cache_creation_input_tokens"]
    assert first["cache_read_input_tokens"] == 0 and written > 80  # image: 80 tokens
    again = emu.post("/v1/messages", headers=A, json=anthropic_body(red, "q2")).json()["usage"]
    assert again["cache_read_input_tokens"] == written
    other = emu.post("/v1/messages", headers=A, json=anthropic_body(black, "q3")).json()["usage"]
    assert other["cache_read_input_tokens"] == 0  # same size, other bytes: a miss
    seen = emu.get("/admin/media").json()
    assert [m["sha256"] for m in seen] == [
        hashlib.sha256(red).hexdigest(),
        hashlib.sha256(red).hexdigest(),
        hashlib.sha256(black).hexdigest(),
    ]
    assert seen[0]["tokens"] == anthropic_tokens(300, 200) == 80


def openai_body(image: bytes, detail: str, question: str) -> dict[str, Any]:
    part = {
        "type": "image_url",
        "image_url": {"url": f"data:image/png;base64,{b64(image)}", "detail": detail},
    }
    return {
        "model": "gpt-5",
        "messages": [
            {"role": "system", "content": LONG},
            {"role": "user", "content": [{"type": "text", "text": "see"}, part]},
            {"role": "user", "content": question},
        ],
    }


def test_openai_counts_tiles_and_keys_on_bytes_and_detail(emu: TestClient) -> None:
    img = png(1024, 1024)
    first = emu.post("/v1/chat/completions", headers=B, json=openai_body(img, "high", "a")).json()
    text_only = emu.post(
        "/v1/chat/completions",
        headers=B,
        json={
            **openai_body(img, "high", "a"),
            "messages": openai_body(img, "high", "a")["messages"][:1],
        },
    ).json()["usage"]["prompt_tokens"]
    assert first["usage"]["prompt_tokens"] > text_only + 765  # the image counts 765
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    again = emu.post("/v1/chat/completions", headers=B, json=openai_body(img, "high", "b")).json()
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > text_only + 765  # read through the image
    low = emu.post("/v1/chat/completions", headers=B, json=openai_body(img, "low", "c")).json()
    # another detail: the cache is read only up to the image
    assert low["usage"]["prompt_tokens_details"]["cached_tokens"] <= text_only
    seen = emu.get("/admin/media").json()
    assert {m["sha256"] for m in seen} == {hashlib.sha256(img).hexdigest()}
    assert [m["tokens"] for m in seen] == [765, 765, 85]


def test_deepseek_takes_no_images(emu: TestClient) -> None:
    r = emu.post("/deepseek/chat/completions", headers=B, json=openai_body(png(8, 8), "low", "q"))
    assert r.status_code == 400


def test_bad_image_bytes_are_a_400(emu: TestClient) -> None:
    body = openai_body(png(8, 8), "low", "q")
    body["messages"][1]["content"][1]["image_url"]["url"] = "data:image/png;base64,AAAA"
    assert emu.post("/v1/chat/completions", headers=B, json=body).status_code == 400
    body["messages"][1]["content"][1]["image_url"]["url"] = "data:image/png;base64,@@"
    assert emu.post("/v1/chat/completions", headers=B, json=body).status_code == 400


def test_gemini_inline_data_counts_258_and_caches_on_identical_bytes(emu: TestClient) -> None:
    img = png(100, 100)

    def body(image: bytes, q: str) -> dict[str, Any]:
        inline = {"inlineData": {"mimeType": "image/png", "data": b64(image)}}
        return {
            "systemInstruction": {"parts": [{"text": LONG * 2}]},
            "contents": [
                {"role": "user", "parts": [{"text": "see"}, inline]},
                {"role": "model", "parts": [{"text": "ok"}]},
                {"role": "user", "parts": [{"text": q}]},
            ],
        }

    url = "/v1beta/models/gemini-2.5-flash:generateContent"
    first = emu.post(url, headers=G, json=body(img, "a")).json()["usageMetadata"]
    again = emu.post(url, headers=G, json=body(img, "b")).json()["usageMetadata"]
    other = emu.post(url, headers=G, json=body(png(100, 100, (1, 2, 3)), "c")).json()
    assert "cachedContentTokenCount" not in first
    through_image = again["cachedContentTokenCount"]
    assert through_image > 258  # through the image's content and the answer
    assert other["usageMetadata"]["cachedContentTokenCount"] < through_image
    assert [m["tokens"] for m in emu.get("/admin/media").json()] == [258, 258, 258]


def test_an_image_of_another_type_than_declared_is_a_400(emu: TestClient) -> None:
    body = openai_body(png(8, 8), "low", "q")
    body["messages"][1]["content"][1]["image_url"]["url"] = (
        f"data:image/jpeg;base64,{b64(png(8, 8))}"
    )
    r = emu.post("/v1/chat/completions", headers=B, json=body)
    assert r.status_code == 400 and "media type" in r.json()["error"]["message"]
