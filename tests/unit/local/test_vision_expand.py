"""A vision prompt's expansion as the gateway serves it: where a prefix of the template ids
(a breakpoint's end) lands in the expanded ids, too many images refused by place, the
images' spans keying their blocks, and the local target seeing only as a VLM."""

from __future__ import annotations

import io
from typing import Any

import pytest

from engines.base import EngineImage, GenerateRequest, SamplingOptions
from gateway.core.config import LOCAL_TARGET
from gateway.local.spans import KVSpans, image_spans
from gateway.local.vision_prompt import ImageRefused, PromptImage, VisionRenderer, is_vision_model
from gateway.service.targets import sees
from manifest.hashing import MMSpan

IMAGE = 7  # the fake tokenizer's <image>


class Tok:
    """Each character one token: ``<image>`` is 7, any other text its code points."""

    def convert_tokens_to_ids(self, token: str) -> int:
        assert token == "<image>"
        return IMAGE

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [1000 + len(text)]  # one token per sequence: its length tells the grid


class Grid:
    def get_number_of_image_patches(self, h: int, w: int, kw: dict[str, Any]) -> tuple[int, ...]:
        return (0, 1, 2) if w > h else (0, 1, 1)


def _renderer(limit: int = 2) -> VisionRenderer:
    return VisionRenderer("m", Tok(), Grid(), 2, limit)


def _img(w: int, h: int, data: bytes = b"png") -> PromptImage:
    """A real PNG of ``w`` x ``h`` (the renderer decodes it once), its colour from ``data``."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), tuple(data[:3].ljust(3, b"\0"))).save(buf, "PNG")
    return PromptImage(buf.getvalue(), w, h)


def test_positions_after_an_image_move_by_its_growth() -> None:
    r = _renderer()
    repl = r.replacement(20, 10)
    # 3 tokens of text, an image, 2 of text, an image, 1 of text
    vp = r.expand([1, 2, 3, IMAGE, 4, 5, IMAGE, 6], [_img(20, 10, b"a"), _img(20, 10, b"b")])
    n = len(repl)
    assert [s.offset for s in vp.spans] == [3, 3 + n + 2]
    assert vp.template_offsets == (3, 6)
    assert vp.position(3) == 3  # the end of the text before the first image
    assert vp.position(4) == 3 + n  # just past the first image
    assert vp.position(6) == 3 + n + 2
    assert vp.position(8) == len(vp.token_ids)


def test_more_images_than_the_limit_refused_at_the_first_past_it() -> None:
    with pytest.raises(ImageRefused) as err:
        _renderer(limit=1).expand([IMAGE, IMAGE], [_img(5, 5), _img(5, 5)])
    assert err.value.index == 1


def test_an_images_blocks_are_keyed_by_it() -> None:
    kv = KVSpans(4, "0", 0.5, 60.0)
    prompt = list(range(16))
    plain = kv.hashes(prompt, None)
    a = kv.hashes(prompt, None, None, (MMSpan("ida", 5, 6),))
    b = kv.hashes(prompt, None, None, (MMSpan("idb", 5, 6),))
    assert a[0] == plain[0]  # before the image
    assert a[1] != plain[1] and a[1] != b[1]  # the image starts in block 1
    assert a[2] != b[2]  # and ends in block 2, its chain differing after


def test_a_requests_image_spans_from_its_engine_images() -> None:
    greq = GenerateRequest(
        "r",
        (1, 2, 3),
        SamplingOptions(max_tokens=1),
        images=(EngineImage(b"x", "image/png", "id1", None, 1, 2),),
        template_token_ids=(1, 7),
    )
    assert image_spans(greq) == (MMSpan("id1", 1, 2),)


def test_the_local_target_sees_only_as_a_vision_model() -> None:
    assert not sees(LOCAL_TARGET)
    assert sees(LOCAL_TARGET, local=True)


def test_a_directory_without_a_vision_config_is_not_a_vision_model(tmp_path: Any) -> None:
    assert not is_vision_model(str(tmp_path))
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    assert not is_vision_model(str(tmp_path))
    (tmp_path / "config.json").write_text('{"architectures": ["Idefics3ForConditionalGeneration"]}')
    assert is_vision_model(str(tmp_path))
