"""The demo vision model's files: an Idefics3 config vLLM serves, a processor built from
local files that expands each image to 16 tokens per 112 px tile of the image fitted to 448 px, plus
16 for its global view, and a chat
template that writes an image where its part stood."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from engines.vllm.demo_vision import DemoVisionSpec, ensure_demo_vision_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_demo_vision_model(tmp_path_factory.mktemp("data"))


def test_config_is_idefics3_with_head_dim_64(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["Idefics3ForConditionalGeneration"]
    text = config["text_config"]
    assert text["hidden_size"] // text["num_attention_heads"] == 64
    vision = config["vision_config"]
    assert vision["hidden_size"] // vision["num_attention_heads"] == 64
    assert (model_dir / "model.safetensors").exists()


def test_built_once(model_dir: Path) -> None:
    before = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_vision_model(model_dir.parent.parent) == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == before


@pytest.mark.parametrize(
    ("size", "tiles"),
    [((320, 240), 4 * 3), ((60, 60), 4 * 4), ((1600, 200), 4 * 1), ((200, 900), 1 * 4)],
)
def test_image_tokens_follow_the_tiles(model_dir: Path, size: tuple[int, int], tiles: int) -> None:
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(model_dir))
    image_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    out = processor(text=["look <image> here"], images=[[Image.new("RGB", size)]])
    ids = out["input_ids"][0]
    per_view = DemoVisionSpec().tile_tokens
    assert per_view == 16
    # resized to fit 448 px (a small image grows), cut in 112 px tiles, plus the global view
    assert sum(1 for t in ids if t == image_id) == per_view * (tiles + 1)


def test_chat_template_places_images(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    msgs: Any = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "first "},
                {"type": "image_url", "image_url": {"url": "x"}},
                {"type": "text", "text": " then"},
            ],
        },
    ]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nfirst <image> then<|im_end|>\n<|im_start|>assistant\n"
    )
