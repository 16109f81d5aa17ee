"""The attachments store and the session log's references to it (issue 47): objects
keyed by sha256, verified on every read; messages keep references, never bytes; an
image-bearing provider request rebuilds byte for byte from the log plus the store, and
a missing or flipped object fails the rebuild, the verify and ``vcache replay`` naming
its digest.  The store tests take ``make_store`` and run again on PostgreSQL in the
stores tier (tests/stores/test_attachments_postgres.py)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from PIL import Image

from engines.providers.base import Attached, CacheDirectives
from engines.providers.specs import adapter_for
from gateway.core.config import AttachmentSettings, Settings
from gateway.core.schemas import ChatCompletionRequest, ChatMessage
from gateway.service.attachment_intake import AttachmentIntake
from gateway.session_cli import replay
from gateway.sessions.attachments import FileAttachments, SqlAttachments
from gateway.sessions.log import AttachmentUnreadable, SessionLog
from gateway.sessions.reconstruct import Reconstructor
from gateway.sessions.render import (
    provider_call,
    request_attachments,
    request_config,
    request_parts,
)
from gateway.sessions.store import SessionStore
from manifest.attachments import Attachment, AttachmentMismatch
from manifest.sessionlog import (
    Event,
    Header,
    HeaderEvent,
    MessageEvent,
    PartRef,
    Reason,
    ReplaceEvent,
    attachment_refs,
    decode,
    encode,
    parts_json,
    parts_of,
)

MakeStore = Callable[..., SessionStore]


def png(w: int, h: int, color: tuple[int, int, int] = (200, 10, 10)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (w, h), color).save(out, format="PNG")
    return out.getvalue()


PNG = Attachment.of(png(40, 30), "image/png")
PDF = Attachment.of(b"%PDF-1.4\n1 0 obj<</Type/Catalog>>endobj\n%%EOF\n", "application/pdf")


def flip(store: SessionStore, digest: str) -> None:
    """Flip one byte of a stored object, behind the store's back."""
    objects = store.attachments
    if isinstance(objects, FileAttachments):
        path = objects.path(digest)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
        return
    assert isinstance(objects, SqlAttachments)
    sql = store._sql
    (data,) = sql.execute("SELECT data FROM attachments WHERE digest = ?", (digest,)).fetchone()
    changed = bytearray(bytes(data))
    changed[len(changed) // 2] ^= 0x01
    sql.execute("UPDATE attachments SET data = ? WHERE digest = ?", (bytes(changed), digest))


def remove(store: SessionStore, digest: str) -> None:
    objects = store.attachments
    if isinstance(objects, FileAttachments):
        objects.path(digest).unlink()
        return
    store._sql.execute("DELETE FROM attachments WHERE digest = ?", (digest,))


def logged_bytes(events: list[Event]) -> int:
    """What ``events`` take in the log: their encodings and the blobs they reference."""
    blobs: dict[str, bytes] = {}
    total = 0
    for e in events:
        enc = encode(e)
        total += len(enc.data)
        blobs.update(enc.blobs)
    return total + sum(len(b) for b in blobs.values())


# ------------------------------------------------------------------ the store


def test_put_is_idempotent_and_get_verifies(make_store: MakeStore) -> None:
    store = make_store()
    store.attachments.put(PNG)
    store.attachments.put(PNG)  # again: nothing changes
    got = store.attachments.get(PNG.ref)
    assert got.data == PNG.data and got.ref == PNG.ref
    assert (got.ref.width, got.ref.height) == (40, 30)


def test_a_missing_object_names_its_digest(make_store: MakeStore) -> None:
    store = make_store()
    with pytest.raises(AttachmentMismatch, match=f"sha256:{PNG.ref.digest}: missing"):
        store.attachments.get(PNG.ref)
    store.attachments.put(PNG)
    remove(store, PNG.ref.digest)
    with pytest.raises(AttachmentMismatch) as e:
        store.attachments.get(PNG.ref)
    assert e.value.digest == PNG.ref.digest


def test_a_flipped_byte_is_refused_and_a_put_repairs_it(make_store: MakeStore) -> None:
    store = make_store()
    store.attachments.put(PNG)
    flip(store, PNG.ref.digest)
    with pytest.raises(AttachmentMismatch, match=f"sha256:{PNG.ref.digest}: the stored bytes"):
        store.attachments.get(PNG.ref)
    store.attachments.put(PNG)  # the same object put again is stored whole again
    assert store.attachments.get(PNG.ref).data == PNG.data


def test_a_reference_with_other_metadata_is_refused(make_store: MakeStore) -> None:
    store = make_store()
    store.attachments.put(PNG)
    other = type(PNG.ref)(PNG.ref.digest, "image/png", PNG.ref.size, 41, 30)
    with pytest.raises(AttachmentMismatch, match=PNG.ref.digest):
        store.attachments.get(other)


def test_objects_are_shared_by_two_stores_and_follow_retention(make_store: MakeStore) -> None:
    """Two gateways over one log share its objects; an object goes with the last session
    that references it (not before its grace, not while another still does)."""
    a = make_store()
    later = make_store(clock=lambda: time.time() + 7200)  # past the sweep's grace
    a.attachments.put(PNG)
    a.attachments.put(PDF)
    assert later.attachments.get(PNG.ref).data == PNG.data  # put through A, read through B
    shown = MessageEvent("user", "see", parts=parts_json(["see", PartRef(PNG.ref)]))
    doc = MessageEvent("user", "read", parts=parts_json([PartRef(PDF.ref, title="a.pdf")]))
    header = Header.make("m", "anthropic/c")
    a.append("s1", [HeaderEvent(header, Reason.INITIAL), shown], new_for="t")
    a.append("s2", [HeaderEvent(header, Reason.INITIAL), shown, doc], new_for="t")
    assert a.attachment_digests() == {PNG.ref.digest, PDF.ref.digest}
    sizes = {s.id: s.bytes for s in a.sessions()}  # a session's bytes count its objects
    events_only = {sid: logged_bytes([e for _, e in a.events(sid)]) for sid in ("s1", "s2")}
    assert sizes["s1"] == events_only["s1"] + PNG.ref.size
    assert sizes["s2"] == events_only["s2"] + PNG.ref.size + PDF.ref.size
    assert a.size_bytes() == sum(events_only.values()) + PNG.ref.size + PDF.ref.size
    a.retain(max_age_s=None, max_bytes=None)  # nothing dropped: both still referenced
    assert later.attachments.get(PDF.ref).data == PDF.data
    # s2 dropped (long untouched): the PDF only it referenced goes, once past its grace
    later._sql.execute("UPDATE sessions SET updated = 0 WHERE id = 's2'")
    assert later.retain(max_age_s=7200 + 600) == ["s2"]
    with pytest.raises(AttachmentMismatch, match="missing"):
        a.attachments.get(PDF.ref)
    assert a.attachments.get(PNG.ref).data == PNG.data  # s1 still references it
    # a fresh object no event references yet is spared (its dispatch may be on its way)
    fresh = Attachment.of(png(3, 3), "image/png")
    a.attachments.put(fresh)
    a.retain(max_age_s=None, max_bytes=None)
    assert a.attachments.get(fresh.ref).data == fresh.data


def test_file_objects_are_written_whole_under_the_data_directory(tmp_path: Path) -> None:
    objects = FileAttachments(tmp_path / "attachments")
    objects.put(PNG)
    path = objects.path(PNG.ref.digest)
    assert path.read_bytes() == PNG.data and path.parent.parent == tmp_path / "attachments"
    assert [p.name for p in path.parent.iterdir()] == [PNG.ref.digest]  # no temp file left
    with pytest.raises(AttachmentMismatch, match="not a sha256 digest"):
        objects.path("../../etc/passwd")


# ------------------------------------------------------------ the log's references


def test_message_parts_round_trip_and_old_digests_do_not_change() -> None:
    parts = parts_json(["look ", PartRef(PNG.ref, detail="high"), PartRef(PDF.ref, title="a")])
    m = MessageEvent("user", "look ", parts=parts)
    again = decode(encode(m).data, lambda d: encode(m).blobs[d])
    assert again == m and again.key()[-1] == parts
    assert parts_of(again) == ("look ", PartRef(PNG.ref, "high"), PartRef(PDF.ref, None, "a"))
    assert json.loads(parts)[1] == {
        "type": "image",
        "digest": PNG.ref.digest,
        "media_type": "image/png",
        "size": PNG.ref.size,
        "width": 40,
        "height": 30,
        "detail": "high",
    }
    assert b"base64" not in encode(m).data and PNG.data not in encode(m).data  # refs only
    found = attachment_refs([m, ReplaceEvent(0, m)])
    assert found == {PNG.ref.digest: PNG.ref, PDF.ref.digest: PDF.ref}
    old = MessageEvent("user", "q")  # no parts: the key (and so its digest) it always had
    assert old.key() == ("user", "q", None)
    assert "parts" not in json.loads(encode(old).data)


# ------------------------------------------------------------------ rebuild


def image_request(data: bytes, detail: str | None = "low") -> ChatCompletionRequest:
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    return ChatCompletionRequest.model_validate(
        {
            "model": "claude",
            "messages": [
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this?"},
                        {"type": "image_url", "image_url": {"url": url, "detail": detail}},
                    ],
                },
            ],
        }
    )


def sent(req: ChatCompletionRequest, target: str) -> tuple[Header, tuple[MessageEvent, ...], bytes]:
    """The live path: header and turns as the log keeps them, the adapter's bytes."""
    system, turns = request_parts(req)
    header = Header.make(req.model, target, system, req.tool_dicts(), request_config(req, None))
    call, _ = provider_call(header, turns, attachments=request_attachments(req))
    body = adapter_for(target.partition("/")[0]).render(call, CacheDirectives()).body
    return header, turns, body


def test_turn_parts_carry_the_verified_bytes_in_order(make_store: MakeStore) -> None:
    store = make_store()
    req = image_request(PNG.data)
    asyncio.run(AttachmentIntake(AttachmentSettings(), store.attachments).take(req))
    _, turns = request_parts(req)
    header = Header.make("claude", "anthropic/claude-x")
    call, _ = provider_call(header, turns, attachments=store.attachments.get)
    (turn,) = call.turns
    assert turn.content == "what is this?"
    assert turn.parts == ("what is this?", Attached(PNG, detail="low"))
    flip(store, PNG.ref.digest)
    with pytest.raises(AttachmentMismatch, match=PNG.ref.digest):
        provider_call(header, turns, attachments=store.attachments.get)
    with pytest.raises(AttachmentMismatch, match="no attachments store"):
        provider_call(header, turns)


@pytest.mark.parametrize("target", ["anthropic/claude-x", "openai/gpt-x", "gemini/gem-x"])
def test_an_image_request_rebuilds_byte_for_byte_and_a_flipped_object_fails(
    make_store: MakeStore, tmp_path: Path, capsys: pytest.CaptureFixture[str], target: str
) -> None:
    store = make_store()
    log = SessionLog(store, Reconstructor(adapter_for, lambda: None), verify=True)
    req = image_request(PNG.data)
    asyncio.run(AttachmentIntake(AttachmentSettings(), store.attachments).take(req))
    header, turns, body = sent(req, target)
    assert base64.b64encode(PNG.data) in body  # the bytes as sent, base64 in the body

    async def dispatch(rid: str) -> None:
        op = log.open("t", header, turns)
        await log.dispatch(op, rid, target, "provider", {}, body)

    asyncio.run(dispatch("req-1"))  # verify on: rebuilt from log + store, equal
    assert log.verified == 1
    row = store.request("req-1")
    assert row is not None
    _, rebuilt = log.rebuild(row.session_id, row.seq)
    assert rebuilt == body
    stored = [e for _, e in store.events(row.session_id) if isinstance(e, MessageEvent)]
    assert stored[0].parts is not None and PNG.ref.digest in stored[0].parts

    flip(store, PNG.ref.digest)
    with pytest.raises(AttachmentMismatch, match=f"sha256:{PNG.ref.digest}"):
        log.rebuild(row.session_id, row.seq)
    with pytest.raises(AttachmentUnreadable) as e:  # the next verify: a 500, named
        asyncio.run(dispatch("req-2"))
    assert e.value.status == 500 and f"sha256:{PNG.ref.digest}" in e.value.message
    assert e.value.code == "attachment_unreadable"
    (q,) = store.quarantined()  # quarantine records it
    assert (q.digest, q.request_id) == (PNG.ref.digest, "req-2") and "stored bytes" in q.why

    if isinstance(store.attachments, FileAttachments):  # vcache replay reads a SQLite log
        settings = Settings(data_dir=tmp_path)
        assert replay(settings, store.path, "req-1", quiet=True) == 1
        err = capsys.readouterr().err
        assert f"sha256:{PNG.ref.digest}" in err and "the stored bytes" in err
        store.attachments.put(PNG)  # the object whole again: replay matches
        assert replay(settings, store.path, "req-1", quiet=True) == 0
        assert "match: the log rebuilds what was sent" in capsys.readouterr().out


def test_the_next_turn_through_another_gateway_rebuilds_from_the_shared_store(
    make_store: MakeStore,
) -> None:
    """The image is sent through gateway A (stored there), the next turn through B: B's
    verify rebuilds both turns' image from the store the gateways share (B's own intake
    here stores nothing, so only A's object can serve it)."""
    target = "anthropic/claude-x"
    a_store, b_store = make_store(), make_store()
    a = SessionLog(a_store, Reconstructor(adapter_for, lambda: None), verify=True)
    b = SessionLog(b_store, Reconstructor(adapter_for, lambda: None), verify=True)
    first = image_request(PNG.data)
    asyncio.run(AttachmentIntake(AttachmentSettings(), a_store.attachments).take(first))
    header, turns, body = sent(first, target)

    async def turn(log: SessionLog, rid: str, turns: tuple[MessageEvent, ...], body: bytes) -> str:
        op = log.open("t", header, turns)
        await log.dispatch(op, rid, target, "provider", {}, body)
        await log.respond(op, rid, "a red square", {"prompt_tokens": 1})
        assert op.session_id is not None
        return op.session_id

    sid = asyncio.run(turn(a, "req-a", turns, body))
    second = image_request(PNG.data)
    second.messages += [
        ChatMessage(role="assistant", content="a red square"),
        ChatMessage(role="user", content="and its size?"),
    ]
    asyncio.run(AttachmentIntake(AttachmentSettings(), None).take(second))  # B stores nothing
    _, turns2, body2 = sent(second, target)
    assert asyncio.run(turn(b, "req-b", turns2, body2)) == sid  # the same conversation
    assert b.verified == 1  # rebuilt through B, the image read from A's object
    row = b_store.request("req-b")
    assert row is not None and b.rebuild(row.session_id, row.seq)[1] == body2
