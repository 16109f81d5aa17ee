"""Image blocks' hash keys as vLLM forms them: the identifier from the image's bytes (or
the client's uuid), and ``("mm", identifier, offset)`` on every block that overlaps the
image's placeholder range, after a LoRA key and before the cache salt."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.local.vision_prompt import Seen, image_identifier, seen
from manifest.hashing import HashKeys, MMSpan, block_hashes


@pytest.mark.parametrize("data", [b"", b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 3])
@pytest.mark.parametrize("model", ["/models/demo-vision", "HuggingFaceTB/SmolVLM-256M"])
def test_identifier_equals_vllms_hasher(data: bytes, model: str) -> None:
    from PIL import Image
    from vllm.multimodal.hasher import MultiModalHasher
    from vllm.multimodal.media.base import MediaWithBytes

    media = MediaWithBytes(Image.new("RGB", (2, 2)), data)
    expected = MultiModalHasher.hash_kwargs("blake3", model_id=model, image=media)
    assert image_identifier(model, data) == expected


def test_a_uuid_is_the_identifier() -> None:
    assert image_identifier("m", b"bytes", uuid="shot-1") == "shot-1"
    assert image_identifier("m", b"bytes") != image_identifier("m", b"bytez")
    assert image_identifier("m", b"bytes") != image_identifier("n", b"bytes")


def test_keys_mark_every_overlapping_block_with_the_items_offset() -> None:
    keys = HashKeys(cache_salt="s", lora_name="a", lora_path="/a", mm=(MMSpan("x", 10, 20),))
    assert keys.for_block(0, 16) == (("lora", "a", "/a"), ("mm", "x", 10), ("cache_salt", "s"))
    assert keys.for_block(1, 16) == (("lora", "a", "/a"), ("mm", "x", -6))
    assert keys.for_block(2, 16) == (("lora", "a", "/a"),)


def test_two_items_in_one_block_keep_their_order() -> None:
    keys = HashKeys(mm=(MMSpan("a", 2, 3), MMSpan("b", 5, 30)))
    assert keys.for_block(0, 16) == (("mm", "a", 2), ("mm", "b", 5))
    assert keys.for_block(1, 16) == (("mm", "b", -11),)
    assert keys.for_block(2, 16) == (("mm", "b", -27),)
    assert keys.for_block(3, 16) is None


def test_the_image_enters_only_the_blocks_it_touches() -> None:
    tokens = list(range(64))
    plain = block_hashes(tokens, 16, "0")
    seen = block_hashes(tokens, 16, "0", HashKeys(mm=(MMSpan("x", 20, 8),)))
    assert seen[0] == plain[0]
    assert seen[1] != plain[1]
    assert seen[2] != plain[2]  # the parent changed
    other = block_hashes(tokens, 16, "0", HashKeys(mm=(MMSpan("x", 21, 8),)))
    assert other[1] != seen[1]  # the same image one token later is another block


def _encoded(img: object, fmt: str, **save: object) -> bytes:
    import io

    from PIL import Image

    assert isinstance(img, Image.Image)
    buf = io.BytesIO()
    img.save(buf, fmt, **save)
    return buf.getvalue()


def _rgba_png() -> bytes:
    from PIL import Image

    return _encoded(Image.new("RGBA", (6, 4), (9, 8, 7, 100)), "PNG")


def _grey_png() -> bytes:
    from PIL import Image

    return _encoded(Image.new("L", (6, 4), 77), "PNG")


def _rotated_jpeg() -> bytes:
    from PIL import Image

    exif = Image.Exif()
    exif[0x0112] = 6  # stored 30 x 10, shown 10 x 30
    return _encoded(Image.new("RGB", (30, 10), (1, 2, 3)), "JPEG", exif=exif.tobytes())


@pytest.mark.parametrize("make", [_rgba_png, _grey_png, _rotated_jpeg])
def test_the_image_is_seen_and_named_as_vllms_server_loads_it(make: Any) -> None:
    """vLLM's server loads a data URL's bytes with ``ImageMediaIO.load_bytes``: upright
    by EXIF, converted to RGB, the conversion hashed with the bytes."""
    from vllm.multimodal.hasher import MultiModalHasher
    from vllm.multimodal.media.image import ImageMediaIO

    data = make()
    media = ImageMediaIO().load_bytes(data)
    look = seen(data)
    assert (look.width, look.height) == media.media.size
    expected = MultiModalHasher.hash_kwargs("blake3", model_id="m", image=media)
    assert image_identifier("m", data, converted=look.converted) == expected


def test_an_exif_orientation_swaps_the_size_a_plain_jpeg_keeps_it() -> None:
    from PIL import Image

    assert seen(_rotated_jpeg()) == Seen(10, 30, False)
    assert seen(_encoded(Image.new("RGB", (30, 10)), "JPEG")) == Seen(30, 10, False)
    assert seen(_rgba_png()).converted and seen(_grey_png()).converted


def test_bytes_no_decoder_takes_are_a_value_error() -> None:
    with pytest.raises(ValueError, match="does not decode"):
        seen(b"\x89PNG\r\n\x1a\nnot really")
