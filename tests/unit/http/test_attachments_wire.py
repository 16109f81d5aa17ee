"""Anthropic's image and document blocks and the Responses API's input_image and input_file
become the chat request's image_url and file parts, where they sit; what cannot be served
is refused by name."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from engines.fake import FakeEngine
from gateway.core.errors import InvalidRequest
from gateway.core.messages_wire import MessagesRequest
from gateway.core.responses_wire import ResponsesRequest
from gateway.core.schemas import Breakpoint, FilePart, ImageUrlPart, TextPart
from gateway.service.messages_api import chat_request, mapped
from gateway.service.part_names import chat_names, client_named
from gateway.service.response_tools import response_tools
from gateway.service.responses_api import chat_turns, named_turns

PNG_B64 = base64.b64encode(b"\x89PNG\r\n\x1a\n not really decoded here").decode()
PDF_B64 = base64.b64encode(b"%PDF-1.4 ...").decode()


def messages(*content: Any, **extra: Any) -> MessagesRequest:
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": list(content)}]}
    return MessagesRequest.model_validate({**body, **extra})


def image(source: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"type": "image", "source": source, **extra}


def test_image_blocks_become_image_url_parts_in_order() -> None:
    b64 = {"type": "base64", "media_type": "image/png", "data": PNG_B64}
    url = {"type": "url", "url": "https://images.example/a.png"}
    chat = chat_request(messages({"type": "text", "text": "compare"}, image(b64), image(url)))
    parts = chat.messages[0].content
    assert isinstance(parts, list)
    assert isinstance(parts[0], TextPart) and parts[0].text == "compare"
    assert isinstance(parts[1], ImageUrlPart) and isinstance(parts[2], ImageUrlPart)
    assert parts[1].image_url.url == f"data:image/png;base64,{PNG_B64}"
    assert parts[2].image_url.url == "https://images.example/a.png"


def test_documents_become_file_parts_title_as_file_name() -> None:
    pdf = {"type": "base64", "media_type": "application/pdf", "data": PDF_B64}
    txt = {"type": "text", "media_type": "text/plain", "data": "ünï text"}
    chat = chat_request(
        messages(
            {"type": "document", "source": pdf, "title": "spec.pdf"},
            {"type": "document", "source": txt},
        )
    )
    parts = chat.messages[0].content
    assert isinstance(parts, list)
    first, second = parts
    assert isinstance(first, FilePart) and isinstance(second, FilePart)
    assert first.file.file_data == f"data:application/pdf;base64,{PDF_B64}"
    assert first.file.filename == "spec.pdf"
    head, data = (second.file.file_data or "").split(",", 1)
    assert head == "data:text/plain;base64"
    assert base64.b64decode(data).decode() == "ünï text" and second.file.filename is None


def test_cache_control_on_an_image_is_a_breakpoint() -> None:
    b64 = {"type": "base64", "media_type": "image/png", "data": PNG_B64}
    marked = image(b64, cache_control={"type": "ephemeral", "ttl": "1h"})
    chat = chat_request(messages({"type": "text", "text": "see"}, marked))
    assert chat.hints.breakpoints == (Breakpoint("message:0", 3600),)


def test_images_inside_a_tool_result() -> None:
    b64 = {"type": "base64", "media_type": "image/png", "data": PNG_B64}
    req = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 8,
            "messages": [
                {"role": "user", "content": "shoot"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "is_error": True,
                            "content": [{"type": "text", "text": "half"}, image(b64)],
                        }
                    ],
                },
            ],
        }
    )
    result = chat_request(req).messages[2]
    assert result.role == "tool" and result.tool_call_id == "t1"
    assert isinstance(result.content, list)
    assert [p.type for p in result.content] == ["text", "text", "image_url"]
    assert result.text() == "[error] half"


@pytest.mark.parametrize(
    ("block", "param"),
    [
        (image({"type": "file", "file_id": "file_1"}), "messages.0.content.0.source.type"),
        (
            {"type": "document", "source": {"type": "url", "url": "https://x.example/a.pdf"}},
            "messages.0.content.0.source.type",
        ),
        (
            {
                "type": "document",
                "source": {"type": "text", "media_type": "text/plain", "data": "x"},
                "citations": {"enabled": True},
            },
            "messages.0.content.0.citations",
        ),
        (
            {
                "type": "document",
                "source": {"type": "text", "media_type": "text/plain", "data": "x"},
                "context": "about x",
            },
            "messages.0.content.0.context",
        ),
        ({"type": "search_result", "source": "s", "title": "t", "content": []}, None),
    ],
)
def test_what_cannot_be_served_is_refused_by_name(block: dict[str, Any], param: str | None) -> None:
    with pytest.raises(InvalidRequest) as err:
        chat_request(messages(block))
    assert err.value.param == (param or "messages.0.content.0.type")
    assert err.value.code == "unsupported_content"


def test_an_image_media_type_anthropic_does_not_take_is_invalid() -> None:
    with pytest.raises(ValidationError):
        messages(image({"type": "base64", "media_type": "image/tiff", "data": PNG_B64}))


def responses(body: dict[str, Any]) -> Any:
    req = ResponsesRequest.model_validate({"model": "m", **body})
    return chat_turns(req.items(), response_tools(req.all_tools()))


def test_input_image_and_input_file_become_chat_parts() -> None:
    data = f"data:image/png;base64,{PNG_B64}"
    turns = responses(
        {
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "look"},
                        {
                            "type": "input_image",
                            "image_url": data,
                            "detail": "low",
                            "uuid": "shot-1",
                        },
                        {
                            "type": "input_file",
                            "file_data": f"data:application/pdf;base64,{PDF_B64}",
                            "filename": "a.pdf",
                        },
                    ],
                }
            ]
        }
    )
    parts = turns[0].content
    assert isinstance(parts, list) and [p.type for p in parts] == ["text", "image_url", "file"]
    assert isinstance(parts[1], ImageUrlPart) and isinstance(parts[2], FilePart)
    assert parts[1].image_url.url == data and parts[1].image_url.detail == "low"
    assert parts[1].uuid == "shot-1"  # vLLM's extension, kept as its image's identity
    assert parts[2].file.filename == "a.pdf"


def test_text_only_input_stays_a_string() -> None:
    turns = responses(
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"}]}]}
    )
    assert turns[0].content == "a"


def test_function_call_output_with_an_image() -> None:
    data = f"data:image/png;base64,{PNG_B64}"
    turns = responses(
        {
            "input": [
                {"type": "function_call", "call_id": "c1", "name": "shot", "arguments": "{}"},
                {
                    "type": "function_call_output",
                    "call_id": "c1",
                    "output": [
                        {"type": "input_text", "text": "screen"},
                        {"type": "input_image", "image_url": data},
                    ],
                },
            ],
            "tools": [{"type": "function", "name": "shot", "parameters": {"type": "object"}}],
        }
    )
    result = turns[1]
    assert result.role == "tool" and result.tool_call_id == "c1"
    assert isinstance(result.content, list)
    assert [p.type for p in result.content] == ["text", "image_url"]


@pytest.mark.parametrize(
    ("part", "says"),
    [
        ({"type": "input_image", "file_id": "file_1"}, "file_id"),
        ({"type": "input_file", "file_id": "file_1"}, "file_id"),
        ({"type": "input_file", "file_url": "https://x.example/a.pdf"}, "file_url"),
        ({"type": "input_image", "image_url": "x"}, "image_url"),
        ({"type": "input_audio", "input_audio": {}}, "input_audio"),
    ],
)
def test_responses_refuses_by_name(part: dict[str, Any], says: str) -> None:
    with pytest.raises(ValidationError, match=says):
        ResponsesRequest.model_validate(
            {"model": "m", "input": [{"role": "user", "content": [part]}]}
        )


def test_errors_name_the_part_the_client_sent() -> None:
    """Intake names chat's parts; each front-end maps them back to its client's."""
    b64 = {"type": "base64", "media_type": "image/png", "data": PNG_B64}
    req = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 8,
            "system": "be brief",
            "messages": [
                {"role": "user", "content": "shoot"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "is_error": True,
                            "content": [image(b64)],
                        },
                        {"type": "text", "text": "and this"},
                        image(b64),
                    ],
                },
            ],
        }
    )
    chat, names = mapped(req)
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool", "user"]
    assert names["messages[3].content[1]"] == "messages.2.content.0.content.0"
    assert names["messages[4].content[1]"] == "messages.2.content.2"
    exc = InvalidRequest(
        "messages[4].content[1]: the data URL's base64 is corrupt",
        param="messages[4].content[1]",
        code="invalid_attachment",
    )
    named = client_named(exc, names)
    assert isinstance(named, InvalidRequest)
    assert (named.message, named.param, named.code) == (
        "messages.2.content.2: the data URL's base64 is corrupt",
        "messages.2.content.2",
        "invalid_attachment",
    )
    other = InvalidRequest("model: no such model", param="model")
    assert client_named(other, names) is other


def test_responses_names_its_input_parts() -> None:
    req = ResponsesRequest.model_validate(
        {
            "model": "m",
            "input": [
                {"role": "user", "content": "plain"},
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "a"},
                        {"type": "input_image", "image_url": f"data:image/png;base64,{PNG_B64}"},
                    ],
                },
            ],
        }
    )
    turns, by_turn = named_turns(req.items(), response_tools(req.all_tools()))
    assert len(turns) == 2
    assert chat_names(1, by_turn) == {
        "messages[2].content[0]": "input[1].content[0]",
        "messages[2].content[1]": "input[1].content[1]",
    }


def test_count_tokens_refuses_an_image_by_name(gw: tuple[FakeEngine, TestClient]) -> None:
    """Token counts are the local model's, and it reads text only: a 400 naming the block."""
    _, http = gw
    b64 = {"type": "base64", "media_type": "image/png", "data": PNG_B64}
    body = {
        "model": "vcache-demo",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, image(b64)]}],
    }
    r = http.post("/v1/messages/count_tokens", json=body, headers={"x-api-key": "k"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith("messages.0.content.1: token counts")
