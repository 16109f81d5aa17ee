"""Intake: the one place every image and document a request carries is decoded (or
fetched), bounded, checked and stored.

Every API brings its images here as OpenAI chat content parts (``image_url``,
``file``; the Messages and Responses APIs' images are converted to them at their
edges).  For each part, in order (its name in errors: ``messages[2].content[1]``;
only user and tool messages carry them):

- a data URL is decoded (base64 only; corrupt base64 is a 400); an http(s) URL is
  fetched only from a host named in ``attachments.fetch_hosts`` (else a 400), with
  the size and time limits (httpx, no redirects); a ``file_id`` is refused by name
  (there is no files API);
- the bytes must be what the part says they are (the media type sniffed from them,
  :func:`manifest.attachments.Attachment.of`), an image within ``max_pixels`` as its
  header states (checked before anything is decoded: decompression bombs), then
  decoded with Pillow, whose size must be the header's (a PNG whose header lies
  fails here); bytes per object, objects per request and bytes per request are
  bounded too (413 for bytes, 400 otherwise);
- only when every part passed are the objects stored (once each, in the
  attachments store beside the session log) and set on their parts
  (``part.attachment``), before the request is prepared and journaled: nothing is
  half-stored, and the dispatch that references an object is journaled after it.

Fetching and decoding run off the event loop; a request with no attachment part
costs one pass over its messages.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import io
import logging
import math
import warnings

import httpx
from PIL import Image

from gateway.core.config import AttachmentSettings
from gateway.core.errors import InvalidRequest, PayloadTooLarge, Unavailable
from gateway.core.schemas import ChatCompletionRequest, FilePart, ImageUrlPart
from gateway.sessions.attachments import AttachmentStore
from manifest.attachments import MEDIA_TYPES, Attachment, sniff

log = logging.getLogger(__name__)

# what a client may call a media type, as the one kept here
_ALIASES = {"image/jpg": "image/jpeg", "image/pjpeg": "image/jpeg"}
# the messages that may carry images and documents (the rest render text only)
_CARRIERS = ("user", "tool")
# the decoder Pillow may use for each image type (no other is tried)
_FORMATS = {"image/png": "PNG", "image/jpeg": "JPEG", "image/gif": "GIF", "image/webp": "WEBP"}


def _bad(where: str, why: str, code: str = "invalid_attachment") -> InvalidRequest:
    return InvalidRequest(f"{where}: {why}", param=where, code=code)


def _too_large(where: str, why: str) -> PayloadTooLarge:
    return PayloadTooLarge(f"{where}: {why}", param=where, code="attachment_too_large")


def media_type(declared: str) -> str:
    """A declared media type as kept here (lower case, no parameters, aliases named)."""
    plain = declared.split(";", 1)[0].strip().lower()
    return _ALIASES.get(plain, plain)


def data_url(where: str, url: str, max_bytes: int) -> tuple[str, bytes]:
    """The media type and bytes of a base64 data URL (``data:image/png;base64,...``)."""
    head, comma, body = url.removeprefix("data:").partition(",")
    params = head.split(";")
    if not comma or "base64" not in [p.strip().lower() for p in params[1:]]:
        raise _bad(where, "a data URL must be base64 (data:<media type>;base64,<data>)")
    if len(body) > 4 * math.ceil(max_bytes / 3):
        raise _too_large(where, f"more than attachments.max_bytes ({max_bytes}) bytes")
    try:
        data = base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError):
        raise _bad(where, "the data URL's base64 is corrupt") from None
    if len(data) > max_bytes:
        raise _too_large(where, f"{len(data)} bytes, more than attachments.max_bytes ({max_bytes})")
    return media_type(params[0]) or "text/plain", data


def checked(where: str, data: bytes, declared: str, max_pixels: int) -> Attachment:
    """The attachment of ``data`` declared as ``declared``, when the bytes are that and an
    image decodes within ``max_pixels`` to the size its header states; else a 400."""
    try:
        att = Attachment.of(data, declared)
    except ValueError as exc:
        raise _bad(where, str(exc)) from None
    ref = att.ref
    if ref.kind != "image":
        return att
    w, h = ref.width or 0, ref.height or 0
    if w * h == 0:
        raise _bad(where, f"the {ref.media_type} header states no pixel size")
    if w * h > max_pixels:
        raise _bad(
            where,
            f"{w}x{h} pixels, more than attachments.max_pixels ({max_pixels})",
            code="image_too_large",
        )
    try:
        with warnings.catch_warnings():  # our own bound is checked above
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=[_FORMATS[ref.media_type]]) as im:
                if im.size != (w, h):
                    raise _bad(where, f"the header says {w}x{h}, the image is {im.size}")
                im.load()
    except InvalidRequest:
        raise
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise _bad(where, f"the {ref.media_type} image does not decode ({exc})") from None
    return att


def _put(store: AttachmentStore, objects: list[Attachment]) -> None:
    """Store ``objects``; a store that fails is a 503 (the request is not sent)."""
    try:
        for a in objects:
            store.put(a)
    except Exception as exc:
        log.warning("attachments store: put failed: %r", exc)
        raise Unavailable(
            "the attachments store is unavailable; retry shortly",
            code="session_log_unavailable",
            retry_after_s=2,
        ) from exc


class AttachmentIntake:
    """Intake of one gateway: its bounds, its store (None: no session log, nothing
    stored), and the transport URL fetches go through (tests hand in a mock)."""

    def __init__(
        self,
        settings: AttachmentSettings,
        store: AttachmentStore | None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.settings = settings
        self._store = store
        self._transport = transport
        self._hosts = {h.lower() for h in settings.fetch_hosts}

    async def take(self, req: ChatCompletionRequest) -> None:
        """Decode or fetch, check and store every image and document of ``req`` and set
        each on its part; an error in the API's terms naming the first bad part."""
        found = [(w, p) for w, p in req.attachment_parts() if p.attachment is None]
        if not found:
            return
        cfg = self.settings
        roles = {f"messages[{i}]": m.role for i, m in enumerate(req.messages)}
        for where, _ in found:
            role = roles[where.partition(".")[0]]
            if role not in _CARRIERS:
                raise _bad(
                    where,
                    f"images and documents are taken in user and tool messages, not in a "
                    f"{role} message",
                )
        if len(found) > cfg.max_count:
            where = found[cfg.max_count][0]
            raise _bad(
                where,
                f"more than attachments.max_count ({cfg.max_count}) images and documents",
                code="too_many_attachments",
            )
        taken: list[tuple[ImageUrlPart | FilePart, Attachment]] = []
        total = 0
        for where, part in found:
            declared, data = await self._bytes(where, part)
            att = await asyncio.to_thread(checked, where, data, declared, cfg.max_pixels)
            total += att.ref.size
            if total > cfg.max_total_bytes:
                raise _too_large(
                    where,
                    f"the request's images and documents pass attachments.max_total_bytes "
                    f"({cfg.max_total_bytes})",
                )
            taken.append((part, att))
        if self._store is not None:
            unique = {a.ref.digest: a for _, a in taken}
            await asyncio.to_thread(_put, self._store, list(unique.values()))
        for part, att in taken:
            part.with_attachment(att)

    async def _bytes(self, where: str, part: ImageUrlPart | FilePart) -> tuple[str, bytes]:
        """The declared media type and the bytes of one part."""
        max_bytes = self.settings.max_bytes
        if isinstance(part, FilePart):
            f = part.file
            if f.file_id is not None:
                raise _bad(
                    f"{where}.file.file_id",
                    "file_id is not supported: there is no files API here; send the file "
                    "as file_data (a base64 data URL)",
                    code="unsupported_parameter",
                )
            if not f.file_data:
                raise _bad(f"{where}.file", "a file part needs file_data (a base64 data URL)")
            if not f.file_data.startswith("data:"):
                raise _bad(f"{where}.file.file_data", "file_data must be a base64 data URL")
            return data_url(where, f.file_data, max_bytes)
        url = part.image_url.url
        if url.startswith("data:"):
            return data_url(where, url, max_bytes)
        return await self._fetch(where, url)

    async def _fetch(self, where: str, url: str) -> tuple[str, bytes]:
        try:
            u = httpx.URL(url)
        except httpx.InvalidURL:
            raise _bad(where, "the image URL is not a URL") from None
        if u.scheme not in ("http", "https"):
            raise _bad(where, "an image URL is a base64 data URL or an http(s) URL")
        host = (u.host or "").lower()
        named = f"{host}:{u.port}" if u.port is not None else host
        if host not in self._hosts and named not in self._hosts:
            raise _bad(
                where,
                f"images are fetched only from the hosts in attachments.fetch_hosts; "
                f"'{named}' is not one (send the image as a base64 data URL)",
                code="fetch_host_not_allowed",
            )
        cfg = self.settings
        try:
            async with asyncio.timeout(cfg.fetch_timeout_s):
                return await self._get(where, u, cfg.max_bytes)
        except TimeoutError:
            raise _bad(
                where, f"fetching the image took longer than {cfg.fetch_timeout_s} s"
            ) from None
        except httpx.HTTPError as exc:
            raise _bad(where, f"the image could not be fetched ({type(exc).__name__})") from None

    async def _get(self, where: str, url: httpx.URL, max_bytes: int) -> tuple[str, bytes]:
        timeout = httpx.Timeout(self.settings.fetch_timeout_s)
        async with (
            httpx.AsyncClient(transport=self._transport, timeout=timeout) as client,
            client.stream("GET", url) as r,
        ):
            if r.status_code != 200:
                raise _bad(where, f"fetching the image answered HTTP {r.status_code}")
            length = r.headers.get("content-length")
            with contextlib.suppress(ValueError):
                if length is not None and int(length) > max_bytes:
                    raise _too_large(
                        where, f"{length} bytes, more than attachments.max_bytes ({max_bytes})"
                    )
            body = bytearray()
            async for chunk in r.aiter_bytes():
                body += chunk
                if len(body) > max_bytes:
                    raise _too_large(where, f"more than attachments.max_bytes ({max_bytes}) bytes")
            declared = media_type(r.headers.get("content-type", ""))
        data = bytes(body)
        if declared not in MEDIA_TYPES:  # none, or application/octet-stream: its bytes say
            declared = sniff(data)[0] or declared or "application/octet-stream"
        return declared, data
