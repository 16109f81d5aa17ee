"""Intake (issue 47): every image and document of a chat request decoded or fetched,
bounded, checked and stored in one place; each bad part a 400 (413 for bytes) naming
it; nothing stored unless every part passed.  And the capability check of the loop: a
target that cannot see (the local model, DeepSeek) is neither quoted nor tried for a
call with images, and a call no target can see is a 400 naming the image."""

from __future__ import annotations

import asyncio
import base64
import io
import random
import struct
import zlib
from collections.abc import Collection, Iterator, Mapping
from contextlib import AbstractContextManager, aclosing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from gateway.core.config import AttachmentSettings
from gateway.core.errors import APIError, InvalidRequest, PayloadTooLarge
from gateway.core.metrics import Metrics
from gateway.core.outputs import Usage
from gateway.core.pieces import Piece, Pieces
from gateway.core.schemas import ChatCompletionRequest
from gateway.core.target import Call, Quote, Sent
from gateway.core.types import Principal, Served
from gateway.service.attachment_intake import AttachmentIntake
from gateway.service.journal import Journal
from gateway.service.loop import ServiceLoop
from gateway.service.targets import sees
from gateway.sessions.attachments import FileAttachments
from gateway.sessions.render import request_parts
from manifest.attachments import Attachment, AttachmentRef
from manifest.sessionlog import Header, MessageEvent, PartRef, parts_of


def png(w: int, h: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (w, h), (10, 200, 30)).save(out, format="PNG")
    return out.getvalue()


def noisy_png(w: int, h: int, seed: int = 0) -> bytes:
    """A PNG that does not compress: about 3 bytes a pixel."""
    out = io.BytesIO()
    noise = random.Random(seed).randbytes(w * h * 3)
    Image.frombytes("RGB", (w, h), noise).save(out, format="PNG")
    return out.getvalue()


def jpeg(w: int, h: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (w, h), (10, 120, 200)).save(out, format="JPEG")
    return out.getvalue()


def lying_png(data: bytes, w: int, h: int) -> bytes:
    """``data`` (a PNG) with an IHDR that says ``w`` x ``h`` (its CRC made right)."""
    ihdr = b"IHDR" + struct.pack(">II", w, h) + data[24:29]
    crc = struct.pack(">I", zlib.crc32(ihdr) & 0xFFFFFFFF)
    return data[:12] + ihdr + crc + data[33:]


PNG = png(20, 10)
PDF = b"%PDF-1.4\n1 0 obj<</Type/Catalog>>endobj\n%%EOF\n"


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


def image(url: str, detail: str | None = None) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, "detail": detail}}


def request(*parts: dict[str, Any], model: str = "m") -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {
            "model": model,
            "messages": [
                {"role": "system", "content": "s"},
                {"role": "user", "content": [{"type": "text", "text": "see"}, *parts]},
            ],
        }
    )


class Recording:
    """An attachments store that keeps what was put."""

    def __init__(self) -> None:
        self.objects: dict[str, Attachment] = {}
        self.puts = 0

    def put(self, attachment: Attachment) -> None:
        self.puts += 1
        self.objects[attachment.ref.digest] = attachment

    def get(self, ref: AttachmentRef) -> Attachment:
        return self.objects[ref.digest]

    def sweep(self, keep: Collection[str], before: float) -> int:
        return 0

    def close(self) -> None:
        pass


def take(
    req: ChatCompletionRequest,
    store: Recording | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    **bounds: Any,
) -> Recording:
    store = store if store is not None else Recording()
    intake = AttachmentIntake(AttachmentSettings(**bounds), store, transport)
    asyncio.run(intake.take(req))
    return store


def refused(req: ChatCompletionRequest, **kw: Any) -> tuple[APIError, Recording]:
    store = Recording()
    with pytest.raises(APIError) as e:
        take(req, store, **kw)
    assert not store.objects, "nothing is stored when a part is refused"
    return e.value, store


# ------------------------------------------------------------------ accepted


def test_a_data_url_image_and_a_pdf_are_stored_once_and_set_on_their_parts() -> None:
    pdf = {
        "type": "file",
        "file": {"file_data": data_url(PDF, "application/pdf"), "filename": "a.pdf"},
    }
    req = request(image(data_url(PNG), "high"), pdf, image(data_url(PNG)))
    store = take(req)
    assert store.puts == 2 and set(store.objects) == {
        Attachment.of(PNG, "image/png").ref.digest,
        Attachment.of(PDF, "application/pdf").ref.digest,
    }
    parts = [p for _, p in req.attachment_parts()]
    assert all(p.attachment is not None for p in parts)
    assert parts[0].attachment is not None and parts[0].attachment.data == PNG
    _, turns = request_parts(req)  # the log keeps references, in order
    got = parts_of(turns[0])
    assert got[0] == "see" and isinstance(got[1], PartRef) and got[1].detail == "high"
    assert isinstance(got[2], PartRef) and got[2].title == "a.pdf"
    assert turns[0].content == "see"


def test_a_text_only_request_costs_nothing() -> None:
    class Untouchable(Recording):
        def put(self, attachment: Attachment) -> None:
            raise AssertionError("nothing to store")

    req = request()
    take(req, Untouchable())
    assert request_parts(req)[1][0].parts is None  # and its event is as before


def test_a_jpg_alias_and_the_file_store_under_the_data_directory(tmp_path: Path) -> None:
    data = jpeg(16, 12)
    req = request(image(data_url(data, "image/jpg")))
    objects = FileAttachments(tmp_path / "attachments")
    asyncio.run(AttachmentIntake(AttachmentSettings(), objects).take(req))
    ((_, part),) = req.attachment_parts()
    assert part.attachment is not None and part.attachment.ref.media_type == "image/jpeg"
    assert objects.get(part.attachment.ref).data == data


# ------------------------------------------------------------------ refused


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("data:image/png;base64,iVBORw0K!!!", "base64 is corrupt"),
        ("data:image/png," + "x" * 10, "must be base64"),
        (data_url(PNG, "image/jpeg"), "the bytes are image/png, not image/jpeg"),
        (data_url(b"hello", "image/png"), "the bytes are not image/png"),
        (data_url(PNG, "image/bmp"), "is not one of"),
        (data_url(lying_png(PNG, 4000, 3000)), "does not decode"),  # header says bigger
        (data_url(PNG[:24] + b"\0" * 9 + PNG[33:]), "does not decode"),  # a broken CRC
        ("ftp://example.com/a.png", "an http(s) URL"),
    ],
)
def test_a_bad_image_is_a_400_naming_the_part(url: str, message: str) -> None:
    err, _ = refused(request(image(data_url(PNG)), image(url)))
    assert isinstance(err, InvalidRequest) and err.status == 400
    assert err.param == "messages[1].content[2]"
    assert message in err.message and err.message.startswith("messages[1].content[2]: ")


def test_a_decompression_bomb_is_refused_before_it_is_decoded() -> None:
    bomb = lying_png(PNG, 100_000, 100_000)  # 10^10 pixels by its header
    err, _ = refused(request(image(data_url(bomb))))
    assert err.status == 400 and err.code == "image_too_large"
    assert "100000x100000 pixels" in err.message and err.param == "messages[1].content[1]"
    err, _ = refused(request(image(data_url(png(30, 30)))), max_pixels=899)
    assert err.code == "image_too_large"


def test_bounds_on_bytes_count_and_total_name_the_part() -> None:
    big = noisy_png(40, 40)
    assert len(big) > 4096
    err, _ = refused(request(image(data_url(big))), max_bytes=4096)
    assert isinstance(err, PayloadTooLarge) and err.status == 413
    assert err.param == "messages[1].content[1]" and "attachments.max_bytes" in err.message
    small = [noisy_png(16, 16, seed) for seed in range(3)]
    assert all(700 < len(s) < 1024 for s in small)
    three = request(*(image(data_url(s)) for s in small))
    err, _ = refused(three, max_count=2)
    assert err.status == 400 and err.code == "too_many_attachments"
    assert err.param == "messages[1].content[3]"  # the first one past the count
    err, _ = refused(three, max_total_bytes=1024)  # the second passes the total
    assert err.status == 413 and err.param == "messages[1].content[2]"
    assert "attachments.max_total_bytes" in err.message


@pytest.mark.parametrize("role", ["system", "assistant"])
def test_an_image_outside_a_user_or_tool_message_is_refused(role: str) -> None:
    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": role, "content": [image(data_url(PNG))]},
                {"role": "user", "content": "and?"},
            ],
        }
    )
    err, _ = refused(req)
    assert err.param == "messages[1].content[0]" and f"not in a {role} message" in err.message


def test_a_file_id_and_a_file_part_without_data_are_refused_by_name() -> None:
    err, _ = refused(request({"type": "file", "file": {"file_id": "file-abc"}}))
    assert err.param == "messages[1].content[1].file.file_id" and "no files API" in err.message
    err, _ = refused(request({"type": "file", "file": {"filename": "a.pdf"}}))
    assert err.param == "messages[1].content[1].file"


# ------------------------------------------------------------------ fetched


def served(routes: Mapping[str, httpx.Response]) -> httpx.MockTransport:
    def handle(r: httpx.Request) -> httpx.Response:
        return routes.get(str(r.url), httpx.Response(404))

    return httpx.MockTransport(handle)


def test_an_url_is_fetched_only_from_an_allowed_host() -> None:
    routes = {
        "https://img.example/a.png": httpx.Response(
            200, content=PNG, headers={"content-type": "image/png"}
        ),
        "https://img.example/raw": httpx.Response(
            200, content=PNG, headers={"content-type": "application/octet-stream"}
        ),
        "https://img.example/big": httpx.Response(200, content=b"\x89PNG" + b"\0" * 5000),
    }
    allowed: dict[str, Any] = {"fetch_hosts": ["img.example"], "transport": served(routes)}
    req = request(image("https://img.example/a.png"), image("https://img.example/raw"))
    store = take(req, **allowed)
    assert [a.data for a in store.objects.values()] == [PNG]  # the same bytes, stored once
    err, _ = refused(request(image("https://elsewhere.example/a.png")), **allowed)
    assert err.code == "fetch_host_not_allowed" and "'elsewhere.example'" in err.message
    assert err.param == "messages[1].content[1]"
    err, _ = refused(request(image("https://img.example/a.png")), transport=served(routes))
    assert err.code == "fetch_host_not_allowed"  # no hosts configured: no URL fetched
    err, _ = refused(request(image("https://img.example/nope")), **allowed)
    assert "answered HTTP 404" in err.message
    err, _ = refused(request(image("https://img.example/big")), max_bytes=1024, **allowed)
    assert err.status == 413 and err.param == "messages[1].content[1]"


def test_a_fetch_that_takes_too_long_is_a_400() -> None:
    class Slow(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            await asyncio.sleep(5)
            return httpx.Response(200, content=PNG)

    err, _ = refused(
        request(image("http://img.example/a.png")),
        fetch_hosts=["img.example"],
        fetch_timeout_s=0.05,
        transport=Slow(),
    )
    assert "took longer than" in err.message and err.param == "messages[1].content[1]"


# ---------------------------------------------------- the loop's capability check


@dataclass(frozen=True)
class Prepared:
    target: str
    request_id: str
    header: Header = field(default_factory=lambda: Header.make("m", "t"))
    turns: tuple[MessageEvent, ...] = ()
    placement: None = None
    notes: Mapping[str, str] = field(default_factory=dict)

    @property
    def sent(self) -> Sent:
        return Sent(self.request_id, self.target, "provider", {}, b"body")


class Seen:
    """A target that records what it was asked and whether the images were taken in."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def admission(self, call: Call) -> AbstractContextManager[None]:
        @contextmanager
        def held() -> Iterator[None]:
            yield

        return held()

    def _taken(self, call: Call) -> bool:
        assert isinstance(call.request, ChatCompletionRequest)
        return all(p.attachment is not None for _, p in call.request.attachment_parts())

    async def quote(self, name: str, call: Call) -> Quote[None] | None:
        self.log.append(f"quote {name} taken={self._taken(call)}")
        return Quote(name, 100, 0, 1.0)

    async def prepare(self, name: str, call: Call, quote: Quote[None] | None = None) -> Prepared:
        self.log.append(f"prepare {name}")
        return Prepared(name, call.request_id)

    async def acquire(self, p: Prepared) -> Prepared:
        return p

    def release(self, p: Prepared) -> None:
        pass

    async def send(self, p: Prepared, session: str | None) -> Pieces:
        yield Piece("ok", "stop")
        yield Piece(usage=Usage.of(1, 1, 0))

    def retry(self, p: Prepared, error: Exception) -> Prepared | None:
        return None

    def settle(self, p: Prepared, usage: Usage) -> None:
        pass


def serve(names: list[str], req: ChatCompletionRequest, log: list[str]) -> Served:
    target = Seen(log)
    intake = AttachmentIntake(AttachmentSettings(), Recording())
    loop = ServiceLoop(Journal(None), Metrics(), lambda _: target, intake)

    async def main() -> Served:
        routed = await loop.first_answer(names, Call(req, Principal(tenant="t"), "r1"))
        async with aclosing(routed.body.pieces) as pieces:
            async for _ in pieces:
                pass
        return routed.served

    return asyncio.run(main())


def test_targets_that_cannot_see_are_neither_quoted_nor_tried() -> None:
    assert not sees("local") and not sees("deepseek/deepseek-chat")
    assert sees("anthropic/claude-x") and sees("openai/gpt-x") and sees("gemini/g")
    log: list[str] = []
    names = ["local", "deepseek/deepseek-chat", "anthropic/claude-x", "openai/gpt-x"]
    out = serve(names, request(image(data_url(PNG))), log)
    assert log == [
        "quote anthropic/claude-x taken=True",  # taken in before anything was quoted
        "quote openai/gpt-x taken=True",
        "prepare anthropic/claude-x",
    ]
    assert out.target == "anthropic/claude-x"
    log.clear()
    serve(["local", "deepseek/deepseek-chat"], request(), log)  # text only: as before
    assert log == [
        "quote local taken=True",
        "quote deepseek/deepseek-chat taken=True",
        "prepare local",
    ]


@pytest.mark.parametrize("names", [["local"], ["local", "deepseek/deepseek-chat"]])
def test_a_call_no_target_can_see_is_a_400_naming_the_image(names: list[str]) -> None:
    log: list[str] = []
    with pytest.raises(InvalidRequest) as e:
        serve(names, request(image(data_url(PNG))), log)
    assert e.value.param == "messages[1].content[1]" and e.value.status == 400
    assert "the local model" in e.value.message and e.value.code == "unsupported_on_target"
    assert log == []  # nothing quoted, prepared or fetched


def test_a_direct_serve_on_the_local_target_refuses_images_by_name() -> None:
    target = Seen([])
    intake = AttachmentIntake(AttachmentSettings(), None)
    loop = ServiceLoop(Journal(None), Metrics(), lambda _: target, intake)
    call = Call(request(image(data_url(PNG))), Principal(tenant="t"), "w1")

    async def main() -> None:
        async with aclosing(loop.serve("local", call).body) as pieces:
            async for _ in pieces:
                pass

    with pytest.raises(InvalidRequest) as e:
        asyncio.run(main())
    assert e.value.param == "messages[1].content[1]"


@settings(max_examples=300, deadline=None)
@given(
    url=st.one_of(
        st.text(min_size=1, max_size=80),
        st.builds(lambda s: "data:" + s, st.text(max_size=80)),
        st.builds(lambda s: "data:image/png;base64," + s, st.text(max_size=80)),
        st.builds(lambda s: "https://" + s, st.text(max_size=40)),
    ),
    as_file=st.booleans(),
)
def test_any_url_or_file_data_is_taken_or_refused_in_the_api_s_terms(
    url: str, as_file: bool
) -> None:
    """What the contract fuzzer may send: never anything but an answer or an APIError."""
    part = {"type": "file", "file": {"file_data": url, "filename": "f"}} if as_file else image(url)
    req = request(part)
    intake = AttachmentIntake(
        AttachmentSettings(fetch_hosts=["img.example"]), Recording(), served({})
    )
    try:
        asyncio.run(intake.take(req))
    except APIError as exc:
        assert exc.status in (400, 413) and exc.param is not None
        assert exc.param.startswith("messages[1].content[1]")
