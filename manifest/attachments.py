"""Attachments: the images and documents a request carries, as immutable objects named
by the SHA-256 digest of their bytes (shared/seeds/000: model-visible ⟺ durably
referenced).

An :class:`AttachmentRef` is what the session log keeps of one: its digest, media
type, byte length and, for an image, its pixel size; never the bytes.  An
:class:`Attachment` is a reference with its bytes, as a request brought them or as the
attachment store gave them back; :meth:`Attachment.verified` checks the bytes against
the reference, so a rebuilt request is built from exactly the bytes that were sent or
fails naming the digest.  :func:`sniff` reads the media type and pixel size from the
bytes' own header (nothing decoded): a declared media type that the bytes contradict
is refused by the caller, never trusted.

Pure: no I/O.  The store is :mod:`gateway.sessions.attachments`; what the client may
send (sizes, counts, pixels) is checked at intake.
"""

from __future__ import annotations

import base64
import hashlib
import struct
from dataclasses import dataclass, field
from typing import Any, Literal

IMAGE_TYPES = ("image/png", "image/jpeg", "image/gif", "image/webp")
DOCUMENT_TYPES = ("application/pdf", "text/plain")
MEDIA_TYPES = IMAGE_TYPES + DOCUMENT_TYPES


class AttachmentMismatch(ValueError):
    """Bytes that are not the object a reference names (another digest, length or
    media type), or no bytes at all: nothing is ever rebuilt from them."""

    def __init__(self, digest: str, why: str) -> None:
        super().__init__(f"attachment sha256:{digest}: {why}")
        self.digest = digest
        self.why = why


@dataclass(frozen=True)
class AttachmentRef:
    """One stored object, as the session log references it."""

    digest: str  # hex SHA-256 of the bytes
    media_type: str  # one of MEDIA_TYPES
    size: int  # bytes
    width: int | None = None  # pixels, images only
    height: int | None = None

    @property
    def kind(self) -> Literal["image", "document"]:
        return "image" if self.media_type in IMAGE_TYPES else "document"

    def as_json(self) -> dict[str, Any]:
        """The reference as the log keeps it (keys sorted by the canonical encoder)."""
        out: dict[str, Any] = {
            "digest": self.digest,
            "media_type": self.media_type,
            "size": self.size,
        }
        if self.width is not None and self.height is not None:
            out["width"], out["height"] = self.width, self.height
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> AttachmentRef:
        return cls(
            str(d["digest"]),
            str(d["media_type"]),
            int(d["size"]),
            None if d.get("width") is None else int(d["width"]),
            None if d.get("height") is None else int(d["height"]),
        )


@dataclass(frozen=True)
class Attachment:
    """A reference with its bytes."""

    ref: AttachmentRef
    data: bytes = field(repr=False)

    @classmethod
    def of(cls, data: bytes, media_type: str) -> Attachment:
        """The attachment of ``data`` declared as ``media_type``; a ValueError naming
        what is wrong when the bytes are not that (or not a type kept here)."""
        found, width, height = sniff(data)
        if media_type not in MEDIA_TYPES:
            raise ValueError(f"media type {media_type!r} is not one of {', '.join(MEDIA_TYPES)}")
        if found is not None and found != media_type:
            raise ValueError(f"the bytes are {found}, not {media_type}")
        if found is None and media_type != "text/plain":
            raise ValueError(f"the bytes are not {media_type}")
        if media_type == "text/plain":
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError("a text/plain document that is not UTF-8") from None
        digest = hashlib.sha256(data).hexdigest()
        return cls(AttachmentRef(digest, media_type, len(data), width, height), data)

    def verified(self) -> Attachment:
        """Self, when the bytes are the object the reference names; else
        :class:`AttachmentMismatch` naming the digest."""
        got = hashlib.sha256(self.data).hexdigest()
        if got != self.ref.digest:
            raise AttachmentMismatch(self.ref.digest, f"the stored bytes hash to {got}")
        if len(self.data) != self.ref.size:
            raise AttachmentMismatch(
                self.ref.digest, f"{len(self.data)} bytes, the log says {self.ref.size}"
            )
        found, width, height = sniff(self.data)
        if self.ref.media_type != "text/plain" and found != self.ref.media_type:
            raise AttachmentMismatch(self.ref.digest, f"not {self.ref.media_type}")
        if (width, height) != (self.ref.width, self.ref.height):
            raise AttachmentMismatch(self.ref.digest, "pixel size differs from the log's")
        return self


def sniff(data: bytes) -> tuple[str | None, int | None, int | None]:
    """The media type the bytes' header names, with an image's width and height as
    that header states them; ``(None, None, None)`` for anything else (text)."""
    if data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) >= 24 and data[12:16] == b"IHDR":
        w, h = struct.unpack(">II", data[16:24])
        return "image/png", w, h
    if data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 10:
        w, h = struct.unpack("<HH", data[6:10])
        return "image/gif", w, h
    if data.startswith(b"\xff\xd8"):
        size = _jpeg_size(data)
        return ("image/jpeg", *size) if size else (None, None, None)
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        size = _webp_size(data)
        return ("image/webp", *size) if size else (None, None, None)
    if data.startswith(b"%PDF-"):
        return "application/pdf", None, None
    return None, None, None


_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    """A JPEG's (width, height) from its first start-of-frame segment."""
    i = 2
    while i + 4 <= len(data):
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:  # no length
            i += 2
            continue
        (length,) = struct.unpack(">H", data[i + 2 : i + 4])
        if marker in _SOF:
            if i + 9 > len(data):
                return None
            h, w = struct.unpack(">HH", data[i + 5 : i + 9])
            return w, h
        i += 2 + length
    return None


def _webp_size(data: bytes) -> tuple[int, int] | None:
    """A WebP's (width, height) from its VP8, VP8L or VP8X chunk."""
    chunk = data[12:16]
    if chunk == b"VP8 " and len(data) >= 30:
        w, h = struct.unpack("<HH", data[26:30])
        return w & 0x3FFF, h & 0x3FFF
    if chunk == b"VP8L" and len(data) >= 25:
        b = data[21:25]
        w = 1 + (((b[1] & 0x3F) << 8) | b[0])
        h = 1 + (((b[3] & 0xF) << 10) | (b[2] << 2) | ((b[1] & 0xC0) >> 6))
        return w, h
    if chunk == b"VP8X" and len(data) >= 30:
        w = 1 + int.from_bytes(data[24:27], "little")
        h = 1 + int.from_bytes(data[27:30], "little")
        return w, h
    return None


def data_url(media_type: str, data: bytes) -> str:
    """``data`` exactly as sent, as a ``data:`` URL of ``media_type`` (never decoded,
    never re-encoded)."""
    return f"data:{media_type};base64,{base64.b64encode(data).decode('ascii')}"
