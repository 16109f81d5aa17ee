"""A small, local demo *vision-language* model: the text demo's counterpart that sees.

The architecture is Idefics3 (``Idefics3ForConditionalGeneration``: a SigLIP-style vision
tower, a pixel-shuffle connector, a Llama decoder), chosen because vLLM 0.32's CPU build
serves it without torchvision: its Qwen2-VL, Qwen2.5/3-VL, Gemma 3, LLaVA (via Pixtral),
Mistral 3 and InternVL modules all import transformers' torchvision image processors at
import time, and torchvision is not installed here (docs/vision.md has the record).

Everything is tiny and random: the text demo's 2-layer, 256-wide decoder (head_dim 64:
vLLM's CPU attention rejects 16) and a 2-block, 128-wide vision tower over 112 px tiles.
An image is resized to fit ``longest_edge`` (448 px), cut into 112 px tiles (up to 4x4)
and shown once more whole (the global view); each tile and the global view is 16
``<image>`` tokens, so an image costs 16 x (rows x cols + 1) tokens plus its framing.

The tokenizer is the text demo's BPE, trained the same way, with Idefics3's image tokens
added; the chat template is ChatML with each image part written as one ``<image>`` where
it stood, which the processor expands.  The image processor (the PIL backend) and the
processor are configured here: no download.  Everything is derived from a
:class:`DemoVisionSpec`; the same spec yields the same files, cached under
``<data_dir>/models/``.  Real deployments configure ``model``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from engines.vllm.demo_model import DemoModelSpec, _train_tokenizer

BUILD_VERSION = 1

IMAGE_TOKEN = "<image>"
FAKE_TOKEN = "<fake_token_around_image>"
GLOBAL_IMAGE = "<global-img>"
IMAGE_SPECIAL_TOKENS = (
    FAKE_TOKEN,
    IMAGE_TOKEN,
    "<end_of_utterance>",
    GLOBAL_IMAGE,
    *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)),
)

# ChatML, with each image part written as one ``<image>`` where the part stood (vLLM's
# processor expands it to the tower's token count): a message's content is a string or a
# list of parts ({"type": "text", "text": ...}, {"type": "image"} or {"type": "image_url"}).
# Tools follow the text demo's Hermes convention.
CHAT_TEMPLATE = (
    "{% macro render(content) %}{% if content is string %}{{ content }}"
    "{% else %}{% for part in content %}"
    "{% if part['type'] in ('image', 'image_url', 'image_pil', 'input_image') %}<image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{% endmacro %}"
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ render(messages[0]['content']) }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions. Their signatures, within <tools></tools>:"
    "\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each call, return a JSON object with the function name and arguments within "
    "<tool_call></tool_call> tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] is defined"
    " and message['tool_calls'] %}"
    "<|im_start|>assistant\n{% if message['content'] %}{{ render(message['content']) }}\n"
    "{% endif %}"
    "{% for call in message['tool_calls'] %}<tool_call>\n"
    '{"name": "{{ call[\'function\'][\'name\'] }}", "arguments": '
    "{{ call['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message['role'] == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ render(message['content']) }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ message['role'] }}\n{{ render(message['content']) }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


@dataclass(frozen=True)
class DemoVisionSpec:
    """Everything that determines the demo vision model's bytes."""

    text: DemoModelSpec = field(
        default_factory=lambda: DemoModelSpec(max_position_embeddings=32768)
    )
    vision_layers: int = 2
    vision_hidden: int = 128
    vision_heads: int = 2  # head_dim 64
    tile: int = 112  # the vision tower's input: each tile and the global view
    patch_size: int = 14
    scale_factor: int = 2  # pixel shuffle: 2x2 patches per token
    longest_edge: int = 448  # images are resized to fit this, then cut into tiles

    @property
    def tile_tokens(self) -> int:
        """The ``<image>`` tokens of one tile (and of the global view)."""
        return (self.tile // self.patch_size) ** 2 // self.scale_factor**2

    @property
    def digest(self) -> str:
        blob = json.dumps({**asdict(self), "build": BUILD_VERSION}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def _add_image_tokens(out: Path) -> dict[str, int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(out))
    tokenizer.add_tokens(list(IMAGE_SPECIAL_TOKENS), special_tokens=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(out))
    names = (IMAGE_TOKEN, "<|im_end|>", "<|endoftext|>")
    return {t: int(tokenizer.convert_tokens_to_ids(t)) for t in names}  # type: ignore[arg-type]


def _save_processor(spec: DemoVisionSpec, out: Path) -> None:
    from transformers import AutoTokenizer, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    images = Idefics3ImageProcessorPil(
        do_image_splitting=True,
        size={"longest_edge": spec.longest_edge},
        max_image_size={"longest_edge": spec.tile},
    )
    processor = Idefics3Processor(
        image_processor=images,
        tokenizer=AutoTokenizer.from_pretrained(str(out)),
        image_seq_len=spec.tile_tokens,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(str(out))


def _build_weights(spec: DemoVisionSpec, out: Path, ids: dict[str, int], vocab: int) -> None:
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, LlamaConfig
    from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig

    t = spec.text
    pad = ids["<|endoftext|>"]
    text = LlamaConfig(
        vocab_size=vocab,
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_hidden_layers=t.num_layers,
        num_attention_heads=t.num_heads,
        num_key_value_heads=t.num_heads,
        max_position_embeddings=t.max_position_embeddings,
        bos_token_id=pad,
        eos_token_id=[ids["<|im_end|>"], pad],
        pad_token_id=pad,
        tie_word_embeddings=False,
    )
    vision = Idefics3VisionConfig(
        hidden_size=spec.vision_hidden,
        intermediate_size=2 * spec.vision_hidden,
        num_hidden_layers=spec.vision_layers,
        num_attention_heads=spec.vision_heads,
        image_size=spec.tile,
        patch_size=spec.patch_size,
    )
    config = Idefics3Config(
        vision_config=vision.to_dict(),
        text_config=text.to_dict(),
        image_token_id=ids[IMAGE_TOKEN],
        scale_factor=spec.scale_factor,
        pad_token_id=pad,
        tie_word_embeddings=False,
    )
    config.eos_token_id = ids["<|im_end|>"]
    torch.manual_seed(t.seed)
    model = Idefics3ForConditionalGeneration(config)  # type: ignore[no-untyped-call]
    model = model.to(torch.bfloat16)  # type: ignore[arg-type]
    model.save_pretrained(str(out), safe_serialization=True)


def ensure_demo_vision_model(data_dir: Path, spec: DemoVisionSpec | None = None) -> Path:
    """Return the directory of the demo vision model, building it once if missing (atomic)."""
    spec = spec or DemoVisionSpec()
    target = data_dir / "models" / f"demo-vision-{spec.digest}"
    if (target / "config.json").exists() and (target / "processor_config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        os.environ.setdefault("RAYON_NUM_THREADS", "1")  # deterministic BPE merges
        _train_tokenizer(spec.text, tmp)
        ids = _add_image_tokens(tmp)
        with open(tmp / "tokenizer.json") as f:
            tok = json.load(f)
        n = len(tok["model"]["vocab"]) + len(tok.get("added_tokens", []))
        vocab = max(spec.text.vocab_size, n, max(ids.values()) + 1)
        vocab = -(-vocab // 64) * 64
        _build_weights(spec, tmp, ids, vocab)
        _save_processor(spec, tmp)
        (tmp / "vcache_demo.json").write_text(json.dumps(asdict(spec), sort_keys=True))
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
