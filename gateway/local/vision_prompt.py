"""Image-bearing prompts for a local vision-language model, rendered as vLLM renders them.

The chat template writes one image token (``<image>``) where each image part stood;
vLLM's processor replaces it with the model's placeholder sequence for that image's
pixel size, and every KV block that overlaps the sequence carries the key
``("mm", identifier, offset)`` (:class:`manifest.hashing.MMSpan`).  This module does the
same from the image's recorded size and original bytes, without decoding pixels:

- the image is seen as vLLM's server loads it (``ImageMediaIO.load_bytes``,
  ``vllm/multimodal/media/image.py``): turned upright by its EXIF orientation
  (``ImageOps.exif_transpose``: a JPEG marked "rotate 90" is counted with its width and
  height swapped) and converted to RGB (:func:`seen`: the image is decoded once, then
  remembered by its bytes' digest);
- the identifier is vLLM's ``MultiModalHasher.hash_kwargs(blake3, model_id=...,
  image=MediaWithBytes(...))`` over the original encoded bytes, with the loader's
  ``io_config`` when the RGB conversion changed the image (the framing of
  ``vllm/multimodal/hasher.py``), or the client's ``uuid`` when it sent one (vLLM takes a
  uuid as the identifier when no processor kwargs are set, as here: two images sent
  under one uuid are one image to the cache);
- the placeholder sequence is the one vLLM's Idefics3 processor builds
  (``vllm/model_executor/models/idefics3.py``, ``get_image_repl``): per tile
  ``<fake_token_around_image><row_r_col_c>`` + ``image_seq_len`` image tokens, a newline
  after each row, then ``\\n<fake_token_around_image><global-img>`` + the global view's
  image tokens + ``<fake_token_around_image>``, the grid from the image processor's
  ``get_number_of_image_patches`` for the upright image's width and height.

Idefics3 (and SmolVLM, the same layout) is the family supported; :meth:`VisionRenderer.load`
returns ``None`` for any other model, which then does not see.
"""

from __future__ import annotations

import contextlib
import io
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from manifest.attachments import Attachment, AttachmentRef
from manifest.hashing import MMSpan
from manifest.sessionlog import PartRef

_LENGTH_BYTES = 8
_TAG_SEQUENCE = b"\x01"
_TAG_MAPPING = b"\x02"
_TAG_LEAF = b"\x03"
# what vLLM's ImageMediaIO hashes beside the bytes when its conversion to RGB (white behind
# transparency) changed the image
_IO_CONFIG: dict[str, Any] = {"image_mode": "RGB", "rgba_background_color": (255, 255, 255)}
_ORIENTATION = 0x0112  # EXIF; 5..8 turn the image a quarter (width and height swap)
_SEEN_REMEMBERED = 256  # images a renderer remembers as seen (by their bytes' digest)
_ARCHITECTURES = frozenset({"Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration"})
IMAGES_PER_PROMPT = 4  # the engine's limit_mm_per_prompt and the renderer's, for a VLM


@dataclass(frozen=True)
class PromptImage:
    """One image of a prompt, in order: its original encoded bytes and pixel size (as
    intake verified them) and the client's ``uuid`` if it sent one."""

    data: bytes
    width: int
    height: int
    uuid: str | None = None


@dataclass(frozen=True)
class VisionPrompt:
    """The prompt's token ids with every image's placeholders expanded, and the images'
    spans (sorted by offset), ready for block hashing and for the engine."""

    token_ids: tuple[int, ...]
    spans: tuple[MMSpan, ...]
    template_offsets: tuple[int, ...] = ()  # where each image token was in the template ids

    def position(self, template_position: int) -> int:
        """Where a position of the template ids (a prefix's end) lands in the expanded ids:
        moved on by every image token before it grown to its placeholders."""
        grown = sum(
            s.length - 1
            for s, t in zip(self.spans, self.template_offsets, strict=True)
            if t < template_position
        )
        return template_position + grown


class ImageRefused(ValueError):
    """An image the model's processor cannot take; ``index`` is its place in the prompt."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(reason)
        self.index = index


@dataclass(frozen=True)
class Seen:
    """An image as vLLM's loader hands it to the processor: its upright size, and whether
    the conversion to RGB changed it (then its identifier hashes the loader's config)."""

    width: int
    height: int
    converted: bool


def seen(data: bytes) -> Seen:
    """How vLLM's server sees ``data`` (``ImageMediaIO.load_bytes``): decoded, its EXIF
    orientation applied as ``ImageOps.exif_transpose`` applies it (a failure to read it
    ignored, as there), and converted to RGB unless it is RGB.  Undecodable bytes: a
    ValueError."""
    from PIL import Image

    try:
        with warnings.catch_warnings():  # intake bounded the pixels
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as im:
                im.load()
                orientation = 1
                with contextlib.suppress(Exception):
                    orientation = int(im.getexif().get(_ORIENTATION, 1))
                w, h = im.size
                if orientation in (5, 6, 7, 8):
                    w, h = h, w
                return Seen(w, h, im.mode != "RGB")
    except (OSError, SyntaxError, Image.DecompressionBombError) as exc:
        raise ValueError(f"the image does not decode ({exc})") from None


def prompt_images(
    parts: Sequence[PartRef], attachments: Callable[[AttachmentRef], Attachment]
) -> list[PromptImage]:
    """The prompt's images (``render.prompt_images``' parts, in order) with their verified
    bytes, the pixel size intake recorded and the client's uuid."""
    out: list[PromptImage] = []
    for i, p in enumerate(parts):
        ref = p.ref
        if ref.width is None or ref.height is None:
            raise ImageRefused(i, f"the image {ref.digest[:12]} has no recorded pixel size")
        out.append(PromptImage(attachments(ref).data, ref.width, ref.height, p.uuid))
    return out


def _architectures(path: str) -> set[str]:
    import json

    config = Path(path) / "config.json"
    if not config.exists():
        return set()
    return set(json.loads(config.read_text()).get("architectures") or [])


def is_vision_model(path: str) -> bool:
    """Whether the model at ``path`` (a local directory) is a vision-language model served
    with images here (the Idefics3 family)."""
    return bool(_architectures(path) & _ARCHITECTURES)


def _framed(chunk: bytes) -> list[bytes]:
    return [len(chunk).to_bytes(_LENGTH_BYTES, "little"), chunk]


def _value(obj: object) -> Iterator[bytes]:
    """vLLM's ``MultiModalHasher.iter_value_to_bytes`` for the values hashed here."""
    if isinstance(obj, tuple):
        yield _TAG_SEQUENCE
        yield len(obj).to_bytes(_LENGTH_BYTES, "little")
        for e in obj:
            yield from _value(e)
    elif isinstance(obj, dict):
        yield _TAG_MAPPING
        yield len(obj).to_bytes(_LENGTH_BYTES, "little")
        for k, v in obj.items():
            yield from _framed(str(k).encode())
            yield from _value(v)
    elif isinstance(obj, bytes):
        yield _TAG_LEAF
        yield from _framed(obj)
    elif isinstance(obj, str):
        yield _TAG_LEAF
        yield from _framed(obj.encode())
    elif isinstance(obj, int):  # np.array(int).tobytes(): int64, little-endian here
        yield _TAG_LEAF
        yield from _framed(obj.to_bytes(8, "little", signed=True))
    else:
        raise TypeError(f"not hashed here: {type(obj).__name__}")


def image_identifier(
    model_id: str, data: bytes, uuid: str | None = None, converted: bool = False
) -> str:
    """vLLM's identifier (``mm_hash``) of an image sent as encoded bytes (``converted``:
    its loader converted it to RGB, so its config is hashed too), or the uuid."""
    if uuid is not None:
        return uuid
    from blake3 import blake3

    h = blake3()
    # hash_kwargs: keys sorted ("image" < "model_id"), each framed, each value tagged; the
    # image is a MediaWithBytes, serialized as the item ("image", original_bytes), or
    # ("image", {"io_config": ..., "data": original_bytes}) when the loader converted it
    item: object = {"io_config": _IO_CONFIG, "data": data} if converted else data
    for chunk in (
        *_framed(b"image"),
        _TAG_LEAF,
        *_framed(b"image"),
        *_value(item),
        *_framed(b"model_id"),
        *_value(model_id),
    ):
        h.update(chunk)
    return str(h.hexdigest())


class VisionRenderer:
    """Expands a templated prompt's image tokens for one Idefics3-family model."""

    def __init__(
        self, model_id: str, tokenizer: Any, image_processor: Any, image_seq_len: int, limit: int
    ) -> None:
        self.model_id = model_id
        self._tok = tokenizer
        self._images = image_processor
        self._seq_len = image_seq_len
        self.limit = limit
        self.image_token_id = int(tokenizer.convert_tokens_to_ids("<image>"))
        self._repl: dict[tuple[int, int], tuple[int, ...]] = {}
        self._seen: OrderedDict[str, Seen] = OrderedDict()

    def seen(self, index: int, data: bytes) -> Seen:
        """:func:`seen`, remembered by the bytes' digest (an agent's screenshots come back
        every turn); undecodable bytes are refused as the ``index``-th image."""
        from blake3 import blake3

        key = str(blake3(data).hexdigest())
        found = self._seen.get(key)
        if found is not None:
            self._seen.move_to_end(key)
            return found
        try:
            found = seen(data)
        except ValueError as exc:
            raise ImageRefused(index, str(exc)) from None
        self._seen[key] = found
        if len(self._seen) > _SEEN_REMEMBERED:
            self._seen.popitem(last=False)
        return found

    @classmethod
    def load(cls, path: str, model_id: str, limit: int) -> VisionRenderer | None:
        """The renderer of the model at ``path`` (a local directory), or ``None`` when it is
        not an Idefics3-family vision-language model."""
        if not is_vision_model(path):
            return None
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(path)  # type: ignore[no-untyped-call]
        return cls(
            model_id, processor.tokenizer, processor.image_processor, processor.image_seq_len, limit
        )

    def replacement(self, width: int, height: int) -> tuple[int, ...]:
        """The placeholder token ids of one image of this size (vLLM's ``get_image_repl``)."""
        key = (width, height)
        cached = self._repl.get(key)
        if cached is not None:
            return cached
        _, rows, cols = self._images.get_number_of_image_patches(height, width, {})
        image = "<image>" * self._seq_len
        fake = "<fake_token_around_image>"
        parts: list[str] = []
        for r in range(rows):
            for c in range(cols):
                parts.append(f"{fake}<row_{r + 1}_col_{c + 1}>{image}")
            parts.append("\n")
        text = "".join([*parts, "\n", f"{fake}<global-img>{image}", fake])
        ids = tuple(int(t) for t in self._tok.encode(text, add_special_tokens=False))
        self._repl[key] = ids
        return ids

    def expand(self, token_ids: Sequence[int], images: Sequence[PromptImage]) -> VisionPrompt:
        """Replace the ``i``-th image token of ``token_ids`` by ``images[i]``'s placeholders."""
        if len(images) > self.limit:
            raise ImageRefused(self.limit, f"at most {self.limit} images per request")
        out: list[int] = []
        spans: list[MMSpan] = []
        at: list[int] = []
        n = 0
        for i, t in enumerate(token_ids):
            if t != self.image_token_id:
                out.append(t)
                continue
            if n >= len(images):
                raise ValueError("the prompt has more image tokens than images")
            img = images[n]
            if img.width <= 0 or img.height <= 0:
                raise ImageRefused(n, "the image has no pixels")
            look = self.seen(n, img.data)
            repl = self.replacement(look.width, look.height)
            ident = image_identifier(self.model_id, img.data, img.uuid, look.converted)
            spans.append(MMSpan(ident, len(out), len(repl)))
            at.append(i)
            out.extend(repl)
            n += 1
        if n != len(images):
            raise ValueError(f"the prompt has {n} image tokens for {len(images)} images")
        return VisionPrompt(tuple(out), tuple(spans), tuple(at))


class RebuildExpander:
    """The session log's rebuild of a local image request: the template ids with the
    logged images (``refs``, read back verified through ``attachments``, with the uuids
    the client gave) expanded as the live path expanded them.  A renderer of its own per
    thread that rebuilds: the live renderer (and its tokenizer, not safe from two threads)
    is the render thread's."""

    def __init__(self, path: str, model_id: str, limit: int) -> None:
        self._path, self._model_id, self._limit = path, model_id, limit
        self._local = threading.local()

    def __call__(
        self,
        ids: Sequence[int],
        refs: Sequence[PartRef],
        attachments: Callable[[AttachmentRef], Attachment],
    ) -> list[int]:
        renderer: VisionRenderer | None = getattr(self._local, "renderer", None)
        if renderer is None:
            renderer = VisionRenderer.load(self._path, self._model_id, self._limit)
            if renderer is None:
                raise ValueError(f"{self._path} is not a vision-language model")
            self._local.renderer = renderer
        return list(renderer.expand(ids, prompt_images(refs, attachments)).token_ids)
