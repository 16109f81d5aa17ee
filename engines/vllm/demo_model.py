"""A small, local demo model so the caching machinery runs on any machine.

The model is a Llama-architecture network with *random* weights and a
byte-level BPE tokenizer trained on a synthetic corpus.  Its output is
gibberish.  It exists so that vLLM, its prefix cache and everything vcache
builds on top of it can run where no real weights can be downloaded (CI, a
laptop, an air-gapped host).  Real deployments configure ``model``.

Everything is derived from a :class:`DemoModelSpec`; the same spec always
yields the same files, which are cached under ``<data_dir>/models/``.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

# ChatML; with ``tools``, the Hermes convention (Qwen-style) that vLLM's ``hermes`` tool
# parser reads: the tools listed in the system turn, calls as <tool_call> JSON, results in
# <tool_response>.  Without tools the rendering is plain ChatML, byte for byte.
# ``enable_thinking: false`` (a chat_template_kwargs variable) opens the answer with an
# empty think block, as Qwen3's template does.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
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
    "<|im_start|>assistant\n{% if message['content'] %}{{ message['content'] }}\n{% endif %}"
    "{% for call in message['tool_calls'] %}<tool_call>\n"
    '{"name": "{{ call[\'function\'][\'name\'] }}", "arguments": '
    "{{ call['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message['role'] == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)

# Bump when the build recipe changes, so cached models built by older code are not reused.
BUILD_VERSION = 4  # 3: tools in the chat template; 4: enable_thinking

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# Common English words so that ordinary prompts tokenize to sensible lengths.
_ENGLISH = tuple(
    (
        "the of and to in is you that it he was for on are as with his they at be this have from "
        "or one had by word but not what all were we when your can said there use an each which "
        "she do how their if will up other about out many then them these so some her would make "
        "like him into time has look two more write go see number no way could people my than "
        "first water been call who oil its now find long down day did get come made may part "
        "system prompt user assistant question answer document cache model token request response "
        "server client data value please explain summarize tell me about following context "
        "instructions helpful"
    ).split()
)


@dataclass(frozen=True)
class DemoModelSpec:
    """Everything that determines the demo model's bytes."""

    seed: int = 0
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 512
    num_layers: int = 2
    num_heads: int = 4  # head_dim = 256 / 4 = 64: vLLM's CPU attention rejects 16
    max_position_embeddings: int = 131072  # a coding agent's context (~48k tokens) fits
    corpus_sentences: int = 20000

    @property
    def digest(self) -> str:
        blob = json.dumps({**asdict(self), "build": BUILD_VERSION}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def _corpus(spec: DemoModelSpec) -> list[str]:
    rng = random.Random(spec.seed)
    syllables = [a + b for a in "bcdfghklmnprstvz" for b in "aeiou"]
    invented = ["".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(1500)]
    words = [*_ENGLISH, *invented]
    lines = []
    for _ in range(spec.corpus_sentences):
        n = rng.randint(4, 16)
        sentence = " ".join(rng.choices(words, k=n))
        lines.append(sentence.capitalize() + rng.choice([".", "?", "!", ",", ":"]))
    return lines


def _train_tokenizer(spec: DemoModelSpec, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(spec), trainer=trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>", "<|endoftext|>"],
        model_max_length=spec.max_position_embeddings,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def _build_weights(spec: DemoModelSpec, out: Path, vocab_size: int) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(out))
    eos = int(tokenizer.convert_tokens_to_ids("<|im_end|>"))  # type: ignore[arg-type]
    pad = int(tokenizer.convert_tokens_to_ids("<|endoftext|>"))  # type: ignore[arg-type]
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=pad,
        eos_token_id=[eos, pad],
        pad_token_id=pad,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]
    model = model.to(torch.bfloat16)  # type: ignore[arg-type]  # what vLLM runs: no cast warnings
    model.save_pretrained(str(out), safe_serialization=True)


def ensure_demo_model(data_dir: Path, spec: DemoModelSpec | None = None) -> Path:
    """Return the directory of the demo model, building it once if missing.

    The build is atomic: files are written to a temporary directory and
    renamed into place, so a crash never leaves a half-written model behind.
    """
    spec = spec or DemoModelSpec()
    target = data_dir / "models" / f"demo-{spec.digest}"
    if (target / "config.json").exists() and (target / "tokenizer.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        os.environ.setdefault("RAYON_NUM_THREADS", "1")  # deterministic BPE merges
        _train_tokenizer(spec, tmp)
        with open(tmp / "tokenizer.json") as f:
            vocab_size = max(spec.vocab_size, len(json.load(f)["model"]["vocab"]))
        _build_weights(spec, tmp, vocab_size)
        (tmp / "vcache_demo.json").write_text(json.dumps(asdict(spec), sort_keys=True))
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").exists():  # lost a race to nobody: re-raise
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
