"""Images and documents in a request: found, decoded, recorded, counted by each provider's rule.

A request's JSON is walked for the shapes each API takes: Anthropic's ``image`` and
``document`` blocks (base64 sources; a text source is text), OpenAI's ``image_url`` and
``file`` parts (data URLs) and the Responses API's ``input_image`` / ``input_file``,
Gemini's ``inlineData``.  Each one found is decoded (bad base64, or an image no
decoder reads or of another type than declared: :class:`BadMedia`, a 400), its
SHA-256 recorded on the emulator's state (:class:`Seen`, for tests to check the bytes
arrived unchanged), and weighed in tokens by the provider's published rule:

- Anthropic: an image is scaled to fit a 1568-pixel long edge and about 1.15
  megapixels (1600 tokens), then costs ``ceil(width * height / 750)`` tokens;
- OpenAI (``detail``): ``low`` costs 85; ``high`` (and ``auto``, counted as high) fits
  the image in 2048 x 2048, scales its short side down to 768, and costs
  85 + 170 per 512-pixel tile;
- Gemini: 258 tokens for an image with both sides at most 384 pixels, else 258 per
  768 x 768 tile;
- a PDF costs what its bytes would as text (4 bytes a token), everywhere.

The bytes themselves stay in the cache key (the piece's bytes are the JSON as
received, base64 and ``detail`` included), so an image-bearing prefix is read from
the cache only when its images are identical byte for byte.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
from dataclasses import dataclass
from typing import Any

from PIL import Image, UnidentifiedImageError

from .state import Seen, compact, tokens

ANTHROPIC_LONG_EDGE = 1568
ANTHROPIC_MAX_TOKENS = 1600  # about 1.15 megapixels
OPENAI_LOW = 85
OPENAI_TILE = 170
GEMINI_IMAGE = 258


class BadMedia(ValueError):
    """An image or a document the provider would refuse (a 400)."""


@dataclass(frozen=True)
class Media:
    media_type: str
    data: bytes
    detail: str | None = None  # OpenAI's


def anthropic_tokens(width: int, height: int) -> int:
    scale = min(1.0, ANTHROPIC_LONG_EDGE / max(width, height))
    w, h = width * scale, height * scale
    if w * h / 750 > ANTHROPIC_MAX_TOKENS:
        shrink = math.sqrt(ANTHROPIC_MAX_TOKENS * 750 / (w * h))
        w, h = w * shrink, h * shrink
    return max(1, math.ceil(int(w) * int(h) / 750))


def openai_tokens(width: int, height: int, detail: str | None) -> int:
    if detail == "low":
        return OPENAI_LOW
    w, h = float(width), float(height)
    if max(w, h) > 2048:
        s = 2048 / max(w, h)
        w, h = w * s, h * s
    if min(w, h) > 768:
        s = 768 / min(w, h)
        w, h = w * s, h * s
    tiles = math.ceil(int(w) / 512) * math.ceil(int(h) / 512)
    return OPENAI_LOW + OPENAI_TILE * tiles


def gemini_tokens(width: int, height: int) -> int:
    if width <= 384 and height <= 384:
        return GEMINI_IMAGE
    return GEMINI_IMAGE * math.ceil(width / 768) * math.ceil(height / 768)


_FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "GIF": "image/gif", "WEBP": "image/webp"}


def pixel_size(data: bytes, media_type: str) -> tuple[int, int]:
    """An image's width and height, from its header (Pillow; nothing decoded); the bytes
    must be the declared type, as every provider checks."""
    try:
        with Image.open(io.BytesIO(data)) as im:
            found, size = _FORMATS.get(str(im.format)), im.size
    except (UnidentifiedImageError, OSError) as exc:
        raise BadMedia("Could not process image") from exc
    if found != media_type:
        raise BadMedia(f"Image does not match the provided media type {media_type}")
    return size


def weigh(provider: str, m: Media) -> int:
    """The tokens one image or document costs at ``provider``."""
    if not m.media_type.startswith("image/"):
        return tokens(m.data)
    w, h = pixel_size(m.data, m.media_type)
    if provider == "anthropic":
        return anthropic_tokens(w, h)
    if provider == "gemini":
        return gemini_tokens(w, h)
    return openai_tokens(w, h, m.detail)


def _b64(text: Any) -> bytes:
    if not isinstance(text, str):
        raise BadMedia("image data: a base64 string is required")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise BadMedia("image data: invalid base64") from exc


def _data_url(url: Any) -> tuple[str, bytes]:
    if not isinstance(url, str) or not url.startswith("data:") or ";base64," not in url:
        raise BadMedia("only base64 data URLs are emulated (the emulator fetches nothing)")
    head, _, data = url.partition(",")
    return head[5:].split(";", 1)[0], _b64(data)


def _found(node: dict[str, Any]) -> tuple[Media, dict[str, Any]] | None:
    """The media ``node`` is, if it is one, and the node with its bytes left out."""
    kind = node.get("type")
    if kind in ("image", "document") and isinstance(node.get("source"), dict):
        src = node["source"]
        if src.get("type") == "text":
            return None  # a text document: text
        if src.get("type") != "base64":
            raise BadMedia(f"{kind} source type {src.get('type')!r} is not emulated")
        media = Media(str(src.get("media_type")), _b64(src.get("data")))
        return media, {**node, "source": {**src, "data": ""}}
    if kind == "image_url" and isinstance(node.get("image_url"), dict):
        img = node["image_url"]
        mt, data = _data_url(img.get("url"))
        return Media(mt, data, img.get("detail")), {**node, "image_url": {**img, "url": ""}}
    if kind == "input_image":
        mt, data = _data_url(node.get("image_url"))
        return Media(mt, data, node.get("detail")), {**node, "image_url": ""}
    if kind == "file" and isinstance(node.get("file"), dict):
        mt, data = _data_url(node["file"].get("file_data"))
        return Media(mt, data), {**node, "file": {**node["file"], "file_data": ""}}
    if kind == "input_file":
        mt, data = _data_url(node.get("file_data"))
        return Media(mt, data), {**node, "file_data": ""}
    inline = node.get("inlineData", node.get("inline_data"))
    if isinstance(inline, dict):
        mt = str(inline.get("mimeType", inline.get("mime_type")))
        return Media(mt, _b64(inline.get("data"))), {"inlineData": {"mimeType": mt}}
    return None


def strip(value: Any, out: list[Media]) -> Any:
    """``value`` without the bytes of the media in it; the media appended to ``out``."""
    if isinstance(value, list):
        return [strip(v, out) for v in value]
    if not isinstance(value, dict):
        return value
    found = _found(value)
    if found is not None:
        out.append(found[0])
        return found[1]
    return {k: strip(v, out) for k, v in value.items()}


class Weigher:
    """One request's media: each value's token weight, and what was seen, recorded."""

    def __init__(self, provider: str) -> None:
        self.provider = provider
        self.seen: list[Seen] = []

    def weight(self, head: bytes, value: Any) -> int | None:
        """The tokens of ``head + compact(value) + "\\n"`` with its media counted by the
        provider's rule (their base64 not counted as text); None when it carries none."""
        media: list[Media] = []
        stripped = strip(value, media)
        if not media:
            return None
        n = tokens(head + compact(stripped) + b"\n")
        for m in media:
            cost = weigh(self.provider, m)
            digest = hashlib.sha256(m.data).hexdigest()
            self.seen.append(Seen(self.provider, digest, m.media_type, len(m.data), m.detail, cost))
            n += cost
        return n
