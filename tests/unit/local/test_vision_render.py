"""The local chat render of a message with images: its parts in order for the template,
each image as ``{"type": "image"}``, and the images listed in prompt order; a text-only
message renders as it always did; a document is refused by its digest."""

from __future__ import annotations

import pytest

from gateway.sessions.render import local_messages, prompt_images
from manifest.attachments import AttachmentMismatch, AttachmentRef
from manifest.sessionlog import MessageEvent, PartRef, parts_json

A = AttachmentRef("a" * 64, "image/png", 10, 320, 240)
B = AttachmentRef("b" * 64, "image/jpeg", 20, 1600, 200)
DOC = AttachmentRef("c" * 64, "application/pdf", 30)


def test_image_parts_keep_their_place() -> None:
    turns = (
        MessageEvent(
            "user", "see  and ", parts=parts_json(["see ", PartRef(A), " and ", PartRef(B)])
        ),
        MessageEvent("assistant", "ok"),
        MessageEvent("user", "", parts=parts_json([PartRef(B)])),
    )
    out = local_messages(("sys",), turns)
    assert out[0] == {"role": "system", "content": "sys"}
    assert out[1]["content"] == [
        {"type": "text", "text": "see "},
        {"type": "image"},
        {"type": "text", "text": " and "},
        {"type": "image"},
    ]
    assert out[2] == {"role": "assistant", "content": "ok"}
    assert out[3]["content"] == [{"type": "image"}]
    assert prompt_images(turns) == [PartRef(A), PartRef(B), PartRef(B)]


def test_a_client_uuid_is_kept_in_the_log_and_given_back_in_prompt_order() -> None:
    turns = (
        MessageEvent(
            "user",
            "",
            parts=parts_json([PartRef(A, detail="low", uuid="shot-1"), PartRef(B)]),
        ),
    )
    assert '"uuid":"shot-1"' in (turns[0].parts or "")
    assert prompt_images(turns) == [PartRef(A, detail="low", uuid="shot-1"), PartRef(B)]


def test_a_document_is_not_shown_to_the_local_model() -> None:
    turns = (MessageEvent("user", "read", parts=parts_json(["read", PartRef(DOC)])),)
    with pytest.raises(AttachmentMismatch) as err:
        local_messages((), turns)
    assert "c" * 12 in str(err.value)
