"""An image-bearing request as the embedded engine hands it to vLLM (no engine started):
the template's ids (vLLM expands them), the images' original bytes, the client's uuids."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any, cast

import pytest
from PIL import Image

from engines.base import EngineImage, GenerateRequest, SamplingOptions
from engines.vllm.engine import _tokens_prompt

if TYPE_CHECKING:
    from vllm.inputs import TokensPrompt
from engines.vllm.engine_config import VllmEngineConfig, engine_args


def _png(size: tuple[int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (10, 20, 30)).save(buf, format="PNG")
    return buf.getvalue()


def _request(images: tuple[EngineImage, ...]) -> GenerateRequest:
    return GenerateRequest(
        request_id="r",
        prompt_token_ids=(1, 9, 9, 9, 9, 2),
        sampling=SamplingOptions(max_tokens=1),
        images=images,
        template_token_ids=(1, 9, 2) if images else None,
    )


def test_a_text_prompt_is_its_token_ids_alone() -> None:
    # rendered already (vLLM's TokensInput): vLLM takes it on the loop, untokenized
    prompt = _tokens_prompt(_request(()))
    assert prompt == {"type": "token", "prompt_token_ids": [1, 9, 9, 9, 9, 2]}


def test_images_go_with_the_template_ids_and_their_original_bytes() -> None:
    a, b = _png((32, 24)), _png((8, 64))
    images = (EngineImage(a, "image/png", "ida"), EngineImage(b, "image/png", "idb"))
    prompt = cast("TokensPrompt", _tokens_prompt(_request(images)))  # a raw prompt
    assert prompt["prompt_token_ids"] == [1, 9, 2]  # not the expanded ids
    data = prompt.get("multi_modal_data")
    assert data is not None
    media = cast(list[Any], data["image"])
    assert [m.original_bytes for m in media] == [a, b]
    assert [m.media.size for m in media] == [(32, 24), (8, 64)]
    assert "multi_modal_uuids" not in prompt  # vLLM hashes the bytes


def test_a_client_uuid_is_passed_where_given() -> None:
    data = _png((16, 16))
    images = (EngineImage(data, "image/png", "u1", uuid="u1"), EngineImage(data, "image/png", "h"))
    prompt = cast("TokensPrompt", _tokens_prompt(_request(images)))
    assert prompt["multi_modal_uuids"] == {"image": ["u1", None]}


def test_images_without_the_template_ids_are_refused() -> None:
    with pytest.raises(ValueError, match="template"):
        GenerateRequest(
            request_id="r",
            prompt_token_ids=(1,),
            sampling=SamplingOptions(max_tokens=1),
            images=(EngineImage(b"x", "image/png", "i"),),
        )


def test_a_vision_model_limits_its_images_per_prompt() -> None:
    vision = VllmEngineConfig(model="m", served_name="s", max_images_per_prompt=4)
    assert engine_args(vision).limit_mm_per_prompt == {"image": 4}
    text = engine_args(VllmEngineConfig(model="m", served_name="s")).limit_mm_per_prompt
    assert text != {"image": 4}  # vLLM's default
