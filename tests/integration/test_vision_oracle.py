"""The gateway's image-bearing prompts equal vLLM's, token for token and block for block.

For the demo vision model, the gateway's rendering (``gateway/local/vision_prompt.py``:
the chat template's ``<image>`` expanded from each image's pixel size, the identifier
from its bytes or uuid) and hashing (``manifest.hashing`` with ``("mm", ...)`` keys) are
compared with vLLM's own input processor and block hasher, called in-process on the same
prompt (no engine is started: building vLLM's config and processor takes seconds), each
image loaded from its bytes as vLLM's server loads a data URL (``ImageMediaIO``: upright
by its EXIF orientation, converted to RGB)."""

from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from PIL import Image

from engines.vllm.demo_vision import ensure_demo_vision_model
from gateway.local.vision_prompt import ImageRefused, PromptImage, VisionPrompt, VisionRenderer
from manifest.hashing import HashKeys, block_hashes

pytestmark = pytest.mark.integration


@dataclass(frozen=True)
class Oracle:
    seed: str
    path: str
    block_size: int
    processor: Any
    tokenizer: Any
    renderer: VisionRenderer

    def template(self, messages: list[dict[str, Any]]) -> list[int]:
        out = self.tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True
        )
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    def vllm(
        self, ids: list[int], images: list[PromptImage]
    ) -> tuple[list[int], list[tuple[str, int, int]], list[bytes]]:
        """vLLM's prompt token ids, mm features and block hashes for the request."""
        from vllm import SamplingParams
        from vllm.multimodal.media.image import ImageMediaIO
        from vllm.utils.hashing import sha256_cbor
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher
        from vllm.v1.request import Request

        media = [ImageMediaIO().load_bytes(i.data) for i in images]
        prompt: dict[str, Any] = {"prompt_token_ids": ids, "multi_modal_data": {"image": media}}
        uuids = [i.uuid for i in images]
        if any(uuids):
            prompt["multi_modal_uuids"] = {"image": uuids}
        req = self.processor.process_inputs(
            "oracle", prompt, SamplingParams(max_tokens=1), ("generate",)
        )
        hasher = get_request_block_hasher(self.block_size, sha256_cbor)
        r = Request.from_engine_core_request(req, hasher)
        feats = [(f.identifier, f.mm_position.offset, f.mm_position.length) for f in r.mm_features]
        return list(r.prompt_token_ids or []), feats, [bytes(h) for h in r.block_hashes]

    def ours(self, ids: list[int], images: list[PromptImage]) -> tuple[VisionPrompt, list[bytes]]:
        vp = self.renderer.expand(ids, images)
        hashes = block_hashes(vp.token_ids, self.block_size, self.seed, HashKeys(mm=vp.spans))
        return vp, [bytes(h) for h in hashes]


@pytest.fixture(scope="module")
def oracle(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Oracle]:
    from transformers import AutoTokenizer
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_none_hash_seed, init_none_hash
    from vllm.v1.engine.input_processor import InputProcessor

    path = str(ensure_demo_vision_model(tmp_path_factory.mktemp("data")))
    config = EngineArgs(
        model=path,
        limit_mm_per_prompt={"image": 2},
        kv_cache_memory_bytes=1 << 29,
        enable_prefix_caching=True,
        prefix_caching_hash_algo="sha256_cbor",
        max_model_len=4096,
    ).create_engine_config()
    renderer = VisionRenderer.load(path, path, limit=2)
    assert renderer is not None
    init_none_hash(sha256_cbor)  # PYTHONHASHSEED when set, else vLLM's default seed
    yield Oracle(
        get_none_hash_seed(),
        path,
        config.cache_config.block_size,
        InputProcessor(config),
        AutoTokenizer.from_pretrained(path),
        renderer,
    )


def _image(
    size: tuple[int, int],
    fmt: str,
    color: tuple[int, int, int],
    orientation: int | None = None,
    mode: str = "RGB",
    uuid: str | None = None,
) -> PromptImage:
    """An image as a client sends it (``size``: its stored pixels, as intake records them;
    ``orientation``: an EXIF orientation tag written into it)."""
    img = Image.new("RGB", size, color)
    for x in range(0, size[0], 7):
        img.putpixel((x, x % size[1]), (x % 256, 0, 255))
    buf = io.BytesIO()
    save: dict[str, Any] = {}
    if orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = orientation
        save["exif"] = exif.tobytes()
    img.convert(mode).save(buf, fmt, **save)
    return PromptImage(buf.getvalue(), size[0], size[1], uuid)


SYSTEM = {"role": "system", "content": "You are a careful visual assistant. " * 12}
PART = {"type": "image_url", "image_url": {"url": "data:"}}


def _chat(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [SYSTEM, {"role": "user", "content": list(parts)}]


CASES = {
    "png 320x240": (
        _chat(PART, {"type": "text", "text": "What is shown?"}),
        [_image((320, 240), "PNG", (200, 30, 60))],
    ),
    "jpeg 1600x200": (
        _chat({"type": "text", "text": "Read the banner: "}, PART),
        [_image((1600, 200), "JPEG", (10, 120, 30))],
    ),
    "two in one message": (
        _chat(PART, {"type": "text", "text": " and "}, PART, {"type": "text", "text": "?"}),
        [_image((64, 64), "PNG", (1, 2, 3)), _image((200, 900), "JPEG", (90, 90, 9))],
    ),
    "a client uuid": (
        _chat(PART, {"type": "text", "text": "Again?"}),
        [_image((320, 240), "PNG", (200, 30, 60), uuid="screenshot-0001")],
    ),
    "jpeg 1600x200 with exif orientation 6 (shown 200x1600)": (
        _chat({"type": "text", "text": "Read the banner: "}, PART),
        [_image((1600, 200), "JPEG", (10, 120, 30), orientation=6)],
    ),
    "rgba png and a grey png (converted to rgb)": (
        _chat(PART, PART, {"type": "text", "text": "Both?"}),
        [
            _image((320, 240), "PNG", (200, 30, 60), mode="RGBA"),
            _image((64, 90), "PNG", (1, 2, 3), mode="L"),
        ],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tokens_spans_and_block_hashes_equal_vllms(oracle: Oracle, case: str) -> None:
    messages, images = CASES[case]
    ids = oracle.template(messages)
    v_ids, v_feats, v_hashes = oracle.vllm(ids, images)
    vp, hashes = oracle.ours(ids, images)
    assert list(vp.token_ids) == v_ids
    assert [(s.identifier, s.offset, s.length) for s in vp.spans] == v_feats
    assert hashes == v_hashes
    assert len(hashes) >= 2  # the images' blocks are full blocks, keyed by them
    if images[0].uuid is not None:
        assert vp.spans[0].identifier == images[0].uuid


def test_exif_orientation_turns_the_grid_as_vllm_sees_it(oracle: Oracle) -> None:
    """A JPEG stored 1600 x 200 and marked "rotate 90" is a 200 x 1600 image to vLLM (4
    rows of one tile, not one row of 4): its placeholders are the upright image's."""
    ids = oracle.template(_chat({"type": "text", "text": "Read the banner: "}, PART))
    marked = _image((1600, 200), "JPEG", (10, 120, 30), orientation=6)
    plain = _image((1600, 200), "JPEG", (10, 120, 30))
    upright = _image((200, 1600), "JPEG", (10, 120, 30))
    v_ids = oracle.vllm(ids, [marked])[0]
    assert list(oracle.ours(ids, [marked])[0].token_ids) == v_ids
    assert v_ids == oracle.vllm(ids, [upright])[0]
    assert v_ids != oracle.vllm(ids, [plain])[0]
    assert len(v_ids) == len(oracle.vllm(ids, [plain])[0]) + 3  # a newline per tile row


def test_two_images_under_one_uuid_share_their_blocks_as_in_vllm(oracle: Oracle) -> None:
    """vLLM's documented behaviour: the client's uuid is the image's identity, so two
    different images sent under one uuid key the same blocks."""
    ids = oracle.template(_chat(PART, {"type": "text", "text": "What is shown?"}))
    red = _image((320, 240), "PNG", (200, 30, 60), uuid="shot-7")
    blue = _image((320, 240), "PNG", (0, 0, 250), uuid="shot-7")
    _, ours_red = oracle.ours(ids, [red])
    vp, ours_blue = oracle.ours(ids, [blue])
    assert ours_red == ours_blue == oracle.vllm(ids, [blue])[2] == oracle.vllm(ids, [red])[2]
    assert vp.spans[0].identifier == "shot-7"
    unnamed = oracle.ours(ids, [_image((320, 240), "PNG", (0, 0, 250))])[1]
    assert (
        unnamed[vp.spans[0].offset // oracle.block_size]
        != ours_blue[vp.spans[0].offset // oracle.block_size]
    )


def test_the_same_image_one_message_later_shares_no_block_past_the_move(oracle: Oracle) -> None:
    img = [_image((320, 240), "PNG", (200, 30, 60))]
    before = oracle.template(_chat(PART, {"type": "text", "text": "What is shown?"}))
    moved = oracle.template(
        [
            SYSTEM,
            {"role": "user", "content": "First a word."},
            {"role": "user", "content": [PART, {"type": "text", "text": "What is shown?"}]},
        ]
    )
    vp_a, ha = oracle.ours(before, img)
    vp_b, hb = oracle.ours(moved, img)
    assert oracle.vllm(moved, img)[2] == hb
    shared = next((i for i, (a, b) in enumerate(zip(ha, hb, strict=False)) if a != b), len(ha))
    first_diff = next(
        i for i, (a, b) in enumerate(zip(vp_a.token_ids, vp_b.token_ids, strict=False)) if a != b
    )
    assert shared == first_diff // oracle.block_size  # nothing past the move is shared


def test_the_image_changes_its_blocks_not_the_text_before_it(oracle: Oracle) -> None:
    ids = oracle.template(_chat(PART, {"type": "text", "text": "What is shown?"}))
    _, red = oracle.ours(ids, [_image((320, 240), "PNG", (200, 30, 60))])
    vp, blue = oracle.ours(ids, [_image((320, 240), "PNG", (0, 0, 250))])
    first_image_block = vp.spans[0].offset // oracle.block_size
    assert red[:first_image_block] == blue[:first_image_block]
    assert red[first_image_block] != blue[first_image_block]


def test_more_images_than_the_limit_are_refused_by_index(oracle: Oracle) -> None:
    ids = oracle.template(_chat(PART, PART, PART))
    img = _image((64, 64), "PNG", (1, 2, 3))
    with pytest.raises(ImageRefused) as err:
        oracle.renderer.expand(ids, [img, img, img])
    assert err.value.index == 2


def test_a_logged_conversation_renders_to_vllms_prompt(oracle: Oracle) -> None:
    """The gateway's own path: the session log's turns (an image part by reference) through
    the local render (``local_messages`` via ``prompts.render``), the image tokens expanded
    with the attachment's verified bytes and recorded size."""
    from engines.tokenizer import ChatTokenizer
    from gateway.local.vision_prompt import prompt_images
    from gateway.service.prompts import render
    from gateway.sessions.render import prompt_images as image_refs
    from manifest.attachments import Attachment, AttachmentRef
    from manifest.sessionlog import MessageEvent, PartRef, parts_json

    shot = Attachment.of(_image((320, 240), "PNG", (200, 30, 60)).data, "image/png")
    jpeg = Attachment.of(_image((1600, 200), "JPEG", (10, 120, 30)).data, "image/jpeg")
    store = {a.ref.digest: a for a in (shot, jpeg)}
    turns = (
        MessageEvent(
            "user",
            "Look: ",
            parts=parts_json(["Look: ", PartRef(shot.ref)]),
        ),
        MessageEvent("assistant", "A red square."),
        MessageEvent(
            "user", "And this?", parts=parts_json([PartRef(jpeg.ref, uuid="banner-1"), "And this?"])
        ),
    )
    tok = ChatTokenizer.from_pretrained(oracle.path)
    ids = render(tok, (SYSTEM["content"],), turns, None)

    def get(ref: AttachmentRef) -> Attachment:
        return store[ref.digest]

    images = prompt_images(image_refs(turns), get)
    assert [(i.width, i.height, i.uuid) for i in images] == [
        (320, 240, None),
        (1600, 200, "banner-1"),
    ]
    v_ids, v_feats, v_hashes = oracle.vllm(ids, images)
    vp, hashes = oracle.ours(ids, images)
    assert list(vp.token_ids) == v_ids
    assert [(s.identifier, s.offset, s.length) for s in vp.spans] == v_feats
    assert hashes == v_hashes
