"""Predicted cached tokens equal the real engine's on image-bearing prompts.

One vLLM CPU engine (the demo vision model, prefix caching with ``sha256_cbor``) is
shared by the module.  Each request is rendered as the gateway renders it
(``gateway/local/vision_prompt.py``): the template's token ids (one ``<image>`` per
image) go to vLLM with the images' original bytes, and vLLM's expansion is checked to be
the gateway's; vLLM expands the ids itself (already-expanded ids would be expanded
again).  The prediction is the number of leading blocks whose hashes
(``manifest.hashing`` with ``("mm", ...)`` keys) an earlier request put in the cache, as
vLLM counts them (never the prompt's last token)."""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from PIL import Image

from engines.vllm.demo_vision import ensure_demo_vision_model
from engines.vllm.engine import close_client_context
from gateway.local.vision_prompt import PromptImage, VisionPrompt, VisionRenderer
from manifest.hashing import HashKeys, block_hashes

pytestmark = pytest.mark.integration

SEED = "0"
SYSTEM = {"role": "system", "content": "You are a careful visual assistant. " * 12}
PART = {"type": "image"}


@dataclass
class Engine:
    llm: Any
    tokenizer: Any
    renderer: VisionRenderer
    block_size: int
    seen: set[bytes]
    template_ids: dict[tuple[int, ...], list[int]]

    def prompt(self, messages: list[dict[str, Any]], images: list[PromptImage]) -> VisionPrompt:
        out = self.tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True
        )
        ids = list(out["input_ids"] if hasattr(out, "keys") else out)
        vp = self.renderer.expand(ids, images)
        self.template_ids[vp.token_ids] = ids
        return vp

    def predict(self, vp: VisionPrompt) -> int:
        hashes = block_hashes(vp.token_ids, self.block_size, SEED, HashKeys(mm=vp.spans))
        most = (len(vp.token_ids) - 1) // self.block_size
        n = 0
        for h in hashes[:most]:
            if bytes(h) not in self.seen:
                break
            n += 1
        return n * self.block_size

    def send(self, vp: VisionPrompt, images: list[PromptImage]) -> tuple[int, float]:
        """vLLM's cached tokens for the request, and its time to the one token."""
        from vllm import SamplingParams
        from vllm.multimodal.media.base import MediaWithBytes

        media = [MediaWithBytes(Image.open(io.BytesIO(i.data)), i.data) for i in images]
        ids = self.template_ids[vp.token_ids]
        prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": media}}
        t0 = time.perf_counter()
        out = self.llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)[0]
        assert list(out.prompt_token_ids) == list(vp.token_ids)  # vLLM's expansion is ours
        elapsed = time.perf_counter() - t0
        hashes = block_hashes(vp.token_ids, self.block_size, SEED, HashKeys(mm=vp.spans))
        self.seen.update(bytes(h) for h in hashes)
        return int(out.num_cached_tokens or 0), elapsed


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    from transformers import AutoTokenizer
    from vllm import LLM

    mp = pytest.MonkeyPatch()
    mp.setenv("PYTHONHASHSEED", SEED)  # vLLM's root block hash (the engine core inherits it)
    path = str(ensure_demo_vision_model(tmp_path_factory.mktemp("data")))
    llm = LLM(
        model=path,
        limit_mm_per_prompt={"image": 2},
        kv_cache_memory_bytes=1 << 29,
        enable_prefix_caching=True,
        prefix_caching_hash_algo="sha256_cbor",
        max_model_len=4096,
    )
    renderer = VisionRenderer.load(path, path, limit=2)
    assert renderer is not None
    block_size = int(llm.llm_engine.vllm_config.cache_config.block_size)
    try:
        yield Engine(llm, AutoTokenizer.from_pretrained(path), renderer, block_size, set(), {})
    finally:
        llm.llm_engine.engine_core.shutdown()
        close_client_context(llm.llm_engine)  # what vLLM's shutdown leaves (engine.py)
        del llm
        mp.undo()


def _image(size: tuple[int, int], fmt: str, color: tuple[int, int, int]) -> PromptImage:
    img = Image.new("RGB", size, color)
    for x in range(0, size[0], 5):
        img.putpixel((x, x % size[1]), (x % 256, 255, 0))
    buf = io.BytesIO()
    img.save(buf, fmt)
    return PromptImage(buf.getvalue(), size[0], size[1])


def test_same_system_and_image_another_question_hits_through_the_image(engine: Engine) -> None:
    shot = [_image((640, 400), "PNG", (20, 40, 200))]
    first = engine.prompt(
        [SYSTEM, {"role": "user", "content": [PART, {"type": "text", "text": "What is it?"}]}], shot
    )
    assert engine.predict(first) == 0
    cold, cold_s = engine.send(first, shot)
    assert cold == 0
    second = engine.prompt(
        [
            SYSTEM,
            {
                "role": "user",
                "content": [PART, {"type": "text", "text": "Which colour dominates?"}],
            },
        ],
        shot,
    )
    predicted = engine.predict(second)
    warm, warm_s = engine.send(second, shot)
    assert warm == predicted
    span = second.spans[0]
    assert predicted >= (span.offset + span.length) // engine.block_size * engine.block_size
    assert predicted > span.offset  # the image's blocks are read from cache
    print(f"\nprefill with a 640x400 image: cold {cold_s:.3f} s, warm {warm_s:.3f} s")


def test_the_image_moved_one_message_later_hits_only_before_the_move(engine: Engine) -> None:
    shot = [_image((320, 240), "JPEG", (200, 30, 60))]
    before = engine.prompt(
        [SYSTEM, {"role": "user", "content": [PART, {"type": "text", "text": "Describe."}]}], shot
    )
    engine.send(before, shot)
    moved = engine.prompt(
        [
            SYSTEM,
            {"role": "user", "content": "One more thing first."},
            {"role": "user", "content": [PART, {"type": "text", "text": "Describe."}]},
        ],
        shot,
    )
    predicted = engine.predict(moved)
    observed, _ = engine.send(moved, shot)
    assert observed == predicted
    first_diff = next(
        i for i, (a, b) in enumerate(zip(before.token_ids, moved.token_ids, strict=False)) if a != b
    )
    assert predicted == first_diff // engine.block_size * engine.block_size
    assert predicted < moved.spans[0].offset


def test_two_images_in_one_message_predicted_exactly(engine: Engine) -> None:
    pair = [_image((64, 64), "PNG", (1, 2, 3)), _image((200, 900), "JPEG", (90, 90, 9))]
    parts: list[dict[str, Any]] = [PART, {"type": "text", "text": " vs "}, PART]
    vp = engine.prompt([SYSTEM, {"role": "user", "content": parts}], pair)
    engine.send(vp, pair)
    more = [*parts, {"type": "text", "text": "?"}]
    again = engine.prompt([SYSTEM, {"role": "user", "content": more}], pair)
    predicted = engine.predict(again)
    observed, _ = engine.send(again, pair)
    assert observed == predicted
    assert predicted >= again.spans[1].offset  # through the first image into the second
