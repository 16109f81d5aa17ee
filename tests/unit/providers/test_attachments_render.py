"""Adapters render a turn's images and documents in each wire format, bytes as received.

The images are real PNG and JPEG bytes made with Pillow; each test decodes what the
adapter put in the body and compares it with the bytes it was given, byte for byte.
"""

from __future__ import annotations

import base64
import io
import json
from typing import Any

import pytest
from PIL import Image

from engines.providers import image_tokens
from engines.providers.anthropic import AnthropicAdapter
from engines.providers.base import (
    Attached,
    CacheDirectives,
    ChatCall,
    ToolCall,
    Turn,
    estimate_tokens,
)
from engines.providers.errors import ProviderBadRequest
from engines.providers.gemini import GeminiAdapter
from engines.providers.openai import DeepSeekAdapter, OpenAIAdapter
from engines.providers.specs import PROVIDERS, sees
from gateway.providers.book import PromptView
from manifest.attachments import Attachment, AttachmentRef


def png(w: int, h: int, color: tuple[int, int, int] = (200, 10, 10)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (w, h), color).save(out, format="PNG")
    return out.getvalue()


def jpeg(w: int, h: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (w, h), (10, 120, 200)).save(out, format="JPEG", quality=71)
    return out.getvalue()


PDF = b"%PDF-1.4\n1 0 obj<</Type/Catalog>>endobj\ntrailer<</Root 1 0 R>>\n%%EOF\n"
PNG = Attachment.of(png(40, 30), "image/png")
JPG = Attachment.of(jpeg(64, 48), "image/jpeg")
DOC = Attachment.of(PDF, "application/pdf")
TXT = Attachment.of("plain words, ünïcode".encode(), "text/plain")


def user_with_images() -> Turn:
    parts = ("look at ", Attached(PNG, detail="high"), "and", Attached(JPG))
    return Turn("user", "look at and", parts=parts)


def call(*turns: Turn) -> ChatCall:
    return ChatCall(model="m", system="S", turns=turns, max_tokens=5)


def body_of(rendered: Any) -> Any:
    return json.loads(rendered.body)


def test_anthropic_image_blocks_in_order_with_exact_bytes() -> None:
    r = AnthropicAdapter().render(call(user_with_images()), CacheDirectives())
    content = body_of(r)["messages"][0]["content"]
    assert [b["type"] for b in content] == ["text", "image", "text", "image"]
    assert content[1]["source"] == {
        "type": "base64",
        "media_type": "image/png",
        "data": base64.b64encode(PNG.data).decode(),
    }
    assert base64.b64decode(content[3]["source"]["data"]) == JPG.data
    assert content[3]["source"]["media_type"] == "image/jpeg"
    # the prompt holds the base64 where the body has it
    assert base64.b64encode(PNG.data) in r.prompt and base64.b64encode(JPG.data) in r.prompt
    assert r.prompt.index(base64.b64encode(PNG.data)) < r.prompt.index(b"and")


def test_anthropic_breakpoint_may_close_on_an_image() -> None:
    t = Turn("user", "see", parts=("see", Attached(PNG)))
    r = AnthropicAdapter().render(call(t), CacheDirectives(breakpoints=("message:0",)))
    last = body_of(r)["messages"][0]["content"][-1]
    assert last["type"] == "image" and last["cache_control"]["type"] == "ephemeral"


def test_anthropic_documents_pdf_and_text_sources() -> None:
    t = Turn(
        "user",
        "read",
        parts=("read", Attached(DOC, title="spec.pdf"), Attached(TXT, title="notes")),
    )
    content = body_of(AnthropicAdapter().render(call(t), CacheDirectives()))["messages"][0][
        "content"
    ]
    assert content[1] == {
        "type": "document",
        "source": {
            "type": "base64",
            "media_type": "application/pdf",
            "data": base64.b64encode(PDF).decode(),
        },
        "title": "spec.pdf",
    }
    assert content[2] == {
        "type": "document",
        "source": {"type": "text", "media_type": "text/plain", "data": "plain words, ünïcode"},
        "title": "notes",
    }


def test_anthropic_image_inside_a_tool_result() -> None:
    ask = Turn("assistant", "", tool_calls=(ToolCall("t1", "shot", "{}"),))
    result = Turn("tool", "screen:", tool_call_id="t1", parts=("screen:", Attached(PNG)))
    msgs = body_of(
        AnthropicAdapter().render(call(Turn("user", "go"), ask, result), CacheDirectives())
    )
    block = msgs["messages"][2]["content"][0]
    assert block["type"] == "tool_result" and block["tool_use_id"] == "t1"
    assert [b["type"] for b in block["content"]] == ["text", "image"]
    assert base64.b64decode(block["content"][1]["source"]["data"]) == PNG.data


def test_openai_image_url_parts_keep_detail_and_bytes() -> None:
    r = OpenAIAdapter().render(call(user_with_images()), CacheDirectives())
    content = body_of(r)["messages"][1]["content"]
    assert [p["type"] for p in content] == ["text", "image_url", "text", "image_url"]
    assert content[1]["image_url"] == {
        "url": "data:image/png;base64," + base64.b64encode(PNG.data).decode(),
        "detail": "high",
    }
    assert "detail" not in content[3]["image_url"]  # as the client sent it: none
    url = content[3]["image_url"]["url"]
    assert base64.b64decode(url.split(",", 1)[1]) == JPG.data
    assert base64.b64encode(JPG.data) in r.prompt


def test_openai_file_part_for_a_pdf_and_text_for_a_text_document() -> None:
    t = Turn("user", "read", parts=("read", Attached(DOC, title="spec.pdf"), Attached(TXT)))
    content = body_of(OpenAIAdapter().render(call(t), CacheDirectives()))["messages"][1]["content"]
    assert content[1] == {
        "type": "file",
        "file": {
            "filename": "spec.pdf",
            "file_data": "data:application/pdf;base64," + base64.b64encode(PDF).decode(),
        },
    }
    assert content[2] == {"type": "text", "text": "plain words, ünïcode"}


def test_openai_tool_result_images_follow_the_run_of_tool_messages() -> None:
    calls = (ToolCall("a", "shot", "{}"), ToolCall("b", "shot", "{}"))
    turns = (
        Turn("user", "go"),
        Turn("assistant", "", tool_calls=calls),
        Turn("tool", "one", tool_call_id="a", parts=("one", Attached(PNG))),
        Turn("tool", "two", tool_call_id="b"),
        Turn("user", "and?"),
    )
    r = OpenAIAdapter().render(call(*turns), CacheDirectives())
    msgs = body_of(r)["messages"]
    assert [m["role"] for m in msgs] == [
        "system",
        "user",
        "assistant",
        "tool",
        "tool",
        "user",
        "user",
    ]
    assert msgs[3]["content"] == "one"  # a tool message takes text only
    assert msgs[5]["content"][0]["type"] == "image_url"
    # the images close the run: they are in the last tool turn's segment, before the next
    pos = r.prompt.index(base64.b64encode(PNG.data))
    assert r.segment_ends["message:2"] < pos < r.segment_ends["message:3"]
    assert r.segment_ends["message:3"] < r.segment_ends["message:4"] == len(r.prompt)


def test_gemini_inline_data_parts() -> None:
    r = GeminiAdapter().render(call(user_with_images()), CacheDirectives())
    parts = body_of(r)["contents"][0]["parts"]
    assert parts[0] == {"text": "look at "}
    assert parts[1] == {
        "inlineData": {"mimeType": "image/png", "data": base64.b64encode(PNG.data).decode()}
    }
    assert base64.b64decode(parts[3]["inlineData"]["data"]) == JPG.data
    assert base64.b64encode(PNG.data) in r.prompt


def test_gemini_tool_result_images_follow_its_function_response() -> None:
    ask = Turn("assistant", "", tool_calls=(ToolCall("t1", "shot", "{}"),))
    result = Turn("tool", "ok", tool_call_id="t1", parts=("ok", Attached(DOC)))
    contents = body_of(
        GeminiAdapter().render(call(Turn("user", "go"), ask, result), CacheDirectives())
    )["contents"]
    parts = contents[2]["parts"]
    assert parts[0]["functionResponse"]["name"] == "shot"
    assert parts[1]["inlineData"]["mimeType"] == "application/pdf"
    assert base64.b64decode(parts[1]["inlineData"]["data"]) == PDF


def test_prompt_differs_exactly_from_the_changed_image_on() -> None:
    """Two prompts that differ only in one image's bytes share every byte before it."""
    other = Attachment.of(png(40, 30, (0, 0, 0)), "image/png")
    for adapter in (AnthropicAdapter(), OpenAIAdapter(), GeminiAdapter()):
        first = Turn("user", "a", parts=("a", Attached(PNG)))
        second = Turn("user", "a", parts=("a", Attached(other)))
        x = adapter.render(call(first), CacheDirectives()).prompt
        y = adapter.render(call(second), CacheDirectives()).prompt
        at = next(i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q)
        assert at >= x.index(base64.b64encode(PNG.data)[:8])
        assert x[:at] == y[:at] and x != y


def test_deepseek_does_not_see() -> None:
    assert not sees("deepseek") and not PROVIDERS["deepseek"].sees
    assert sees("anthropic") and sees("openai") and sees("gemini")
    with pytest.raises(ProviderBadRequest, match="messages\\[0\\]"):
        DeepSeekAdapter().render(call(user_with_images()), CacheDirectives())


def test_image_token_rules() -> None:
    def ref(w: int, h: int) -> AttachmentRef:
        return AttachmentRef("0" * 64, "image/png", 10, w, h)

    assert image_tokens.anthropic(ref(300, 200)) == 80  # ceil(60000 / 750)
    assert image_tokens.anthropic(ref(3000, 1500)) == pytest.approx(1600, abs=1)
    assert image_tokens.openai(ref(1024, 1024), "high") == 765
    assert image_tokens.openai(ref(2048, 4096), None) == 1105
    assert image_tokens.openai(ref(4096, 4096), "low") == 85
    assert image_tokens.gemini(ref(384, 300)) == 258
    assert image_tokens.gemini(ref(1600, 900)) == 258 * 6
    assert image_tokens.anthropic(DOC.ref) == -(-len(PDF) // 4)  # a PDF: as its bytes


def test_renders_say_where_images_sit_and_what_they_cost() -> None:
    """The planner's estimate counts an image as the provider does, not as its base64."""
    for adapter, cost in (
        (AnthropicAdapter(), image_tokens.anthropic(PNG.ref)),
        (OpenAIAdapter(), image_tokens.openai(PNG.ref, "high")),
        (GeminiAdapter(), image_tokens.gemini(PNG.ref)),
    ):
        t = Turn("user", "a", parts=("a", Attached(PNG, detail="high"), "b"))
        r = adapter.render(call(t), CacheDirectives())
        (span,) = r.media
        b64 = base64.b64encode(PNG.data)
        assert r.prompt[span.start : span.end] == b64 and span.tokens == cost
        end = r.segment_ends["message:0"]
        text = end - len(b64)
        assert estimate_tokens(end, r.media) == -(-text // 4) + cost
        assert estimate_tokens(span.start, r.media) == -(-span.start // 4)
        view = PromptView.of(
            "x", "t", r.prompt, dict(r.segment_ends), ["system", "message:0"], r.media
        )
        assert view.tokens[-1] == -(-text // 4) + cost


def test_calibration_scales_the_text_and_leaves_the_images_as_counted() -> None:
    """The provider's count of a prefix: its text scaled by the prompt's text calibration,
    its images as the provider's rule counts them (never scaled)."""
    t = Turn("user", "a" * 400, parts=("a" * 400, Attached(PNG, detail="high"), "b" * 400))
    r = AnthropicAdapter().render(call(t), CacheDirectives())
    keys = ["system", "message:0"]
    view = PromptView.of("x", "t", r.prompt, dict(r.segment_ends), keys, r.media)
    (span,) = r.media
    images = view.media_tokens[-1]
    assert images == span.tokens and view.media_tokens[0] == 0  # the system has none
    text = view.total_tokens - images
    # the provider counts 10% more text tokens than estimated, the image as its rule says
    scale = view.calibration(round(text * 1.1) + images)
    assert scale == pytest.approx(1.1, rel=0.01)
    assert view.scaled(1, scale) == pytest.approx(text * scale + images)
    assert view.scaled(0, scale) == pytest.approx(view.tokens[0] * scale)


def test_a_break_inside_an_image_names_the_image() -> None:
    """A believed-warm prefix read cold names the part its first diverging byte is in:
    an image by its digest (the screenshot an agent stripped or replaced), else the
    segment."""
    t = Turn("user", "a" * 40, parts=("a" * 40, Attached(PNG), "b" * 40))
    r = AnthropicAdapter().render(call(t), CacheDirectives())
    keys = ["system", "message:0"]
    view = PromptView.of("x", "t", r.prompt, dict(r.segment_ends), keys, r.media)
    (span,) = r.media
    assert view.part_at(span.start + 3) == f"image sha256:{PNG.ref.digest}"
    assert view.part_at(span.start - 1) == "message:0"
    assert view.part_at(0) == "system" and view.part_at(None) is None
    assert view.part_at(len(r.prompt) + 10) is None
