"""Image blocks' hash keys as vLLM forms them: the identifier from the image's bytes (or
the client's uuid), and ``("mm", identifier, offset)`` on every block that overlaps the
image's placeholder range, after a LoRA key and before the cache salt."""

from __future__ import annotations

import pytest

from gateway.local.vision_prompt import image_identifier
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
