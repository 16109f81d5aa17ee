"""What an image costs in tokens at each provider, by its published rule, from the pixel
size intake recorded (nothing decoded here).

The prompt bytes an adapter renders hold an image as the base64 of its bytes, which is
no measure of what the provider counts for it: the planner's token estimate of a
prefix counts each image by these rules instead (:class:`~engines.providers.base.MediaSpan`).

- Anthropic: scaled to fit a 1568-pixel long edge and about 1.15 megapixels (1600
  tokens), then ``ceil(width * height / 750)``;
- OpenAI (``detail``): ``low`` 85; ``high`` and ``auto`` fit 2048 x 2048, scale the
  short side down to 768, then 85 + 170 per 512-pixel tile;
- Gemini: 258 for an image with both sides at most 384 pixels, else 258 per 768 x 768
  tile.

A document (a PDF) and an image whose size is unknown count as their bytes would as
text (4 bytes a token).
"""

from __future__ import annotations

import math

from manifest.attachments import AttachmentRef

ANTHROPIC_LONG_EDGE = 1568
ANTHROPIC_MAX_TOKENS = 1600
OPENAI_BASE = 85
OPENAI_TILE = 170
GEMINI_TILE = 258


def _bytes(ref: AttachmentRef) -> int:
    return -(-ref.size // 4)


def anthropic(ref: AttachmentRef) -> int:
    if ref.width is None or ref.height is None or ref.kind != "image":
        return _bytes(ref)
    w, h = float(ref.width), float(ref.height)
    scale = min(1.0, ANTHROPIC_LONG_EDGE / max(w, h, 1.0))
    w, h = w * scale, h * scale
    if w * h / 750 > ANTHROPIC_MAX_TOKENS:
        shrink = math.sqrt(ANTHROPIC_MAX_TOKENS * 750 / (w * h))
        w, h = w * shrink, h * shrink
    return max(1, math.ceil(int(w) * int(h) / 750))


def openai(ref: AttachmentRef, detail: str | None) -> int:
    if ref.width is None or ref.height is None or ref.kind != "image":
        return _bytes(ref)
    if detail == "low":
        return OPENAI_BASE
    w, h = float(ref.width), float(ref.height)
    if max(w, h) > 2048:
        s = 2048 / max(w, h)
        w, h = w * s, h * s
    if min(w, h) > 768:
        s = 768 / min(w, h)
        w, h = w * s, h * s
    return OPENAI_BASE + OPENAI_TILE * math.ceil(int(w) / 512) * math.ceil(int(h) / 512)


def gemini(ref: AttachmentRef) -> int:
    if ref.width is None or ref.height is None or ref.kind != "image":
        return _bytes(ref)
    if ref.width <= 384 and ref.height <= 384:
        return GEMINI_TILE
    return GEMINI_TILE * math.ceil(ref.width / 768) * math.ceil(ref.height / 768)
