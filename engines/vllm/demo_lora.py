"""Small random LoRA adapters for the demo model, built locally (no download).

Each adapter is PEFT's format as vLLM loads it (``adapter_config.json`` and
``adapter_model.safetensors``): rank ``rank`` on every layer's ``q_proj`` and
``v_proj``, weights drawn from a seeded generator, so one seed always yields the
same bytes.  Its output differs from the base model's and from another seed's (the
weights are random: it is as much gibberish as the demo model's), which is all the
tests and the examples need to tell the adapters apart.  Adapters are cached under
``<data_dir>/loras/<name>-<digest>/``; the build is atomic, as the demo model's is.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

DEMO_ADAPTERS = ("demo-lora-a", "demo-lora-b")  # the names the examples serve them by
BUILD_VERSION = 1


@dataclass(frozen=True)
class DemoLoraSpec:
    """Everything that determines a demo adapter's bytes (with its base model's config)."""

    seed: int = 1
    rank: int = 8
    scale: float = 0.02  # the random weights' standard deviation


def _digest(spec: DemoLoraSpec, config: dict[str, object]) -> str:
    blob = json.dumps(
        {"seed": spec.seed, "rank": spec.rank, "scale": spec.scale, "base": config},
        sort_keys=True,
    ).encode()
    return hashlib.sha256(blob + f"build={BUILD_VERSION}".encode()).hexdigest()[:16]


def _int(config: dict[str, object], key: str, default: int | None = None) -> int:
    value = config.get(key)
    if isinstance(value, int) and value > 0:
        return value
    if default is None:
        raise ValueError(f"the base model's config.json has no {key}")
    return default


def _write(base: Path, config: dict[str, object], spec: DemoLoraSpec, out: Path) -> None:
    import torch
    from safetensors.torch import save_file

    hidden, layers = _int(config, "hidden_size"), _int(config, "num_hidden_layers")
    heads = _int(config, "num_attention_heads")
    kv_heads = _int(config, "num_key_value_heads", heads)
    head_dim = _int(config, "head_dim", hidden // heads)
    gen = torch.Generator().manual_seed(spec.seed)
    tensors: dict[str, torch.Tensor] = {}
    for i in range(layers):
        for proj, rows in (("q_proj", heads * head_dim), ("v_proj", kv_heads * head_dim)):
            key = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            a = torch.randn(spec.rank, hidden, generator=gen) * spec.scale
            b = torch.randn(rows, spec.rank, generator=gen) * spec.scale
            tensors[f"{key}.lora_A.weight"] = a.to(torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = b.to(torch.bfloat16)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    peft = {
        "peft_type": "LORA",
        "r": spec.rank,
        "lora_alpha": 2 * spec.rank,
        "lora_dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"],
        "bias": "none",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "fan_in_fan_out": False,
        "modules_to_save": None,
    }
    (out / "adapter_config.json").write_text(json.dumps(peft, sort_keys=True))


def ensure_demo_lora(data_dir: Path, base: Path, name: str, spec: DemoLoraSpec) -> Path:
    """The directory of the demo adapter ``name`` for the model at ``base`` (its
    ``config.json`` gives the shapes), built once if missing."""
    config = json.loads((base / "config.json").read_text())
    target = data_dir / "loras" / f"{name}-{_digest(spec, config)}"
    if (target / "adapter_model.safetensors").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        _write(base, config, spec, tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "adapter_model.safetensors").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def ensure_demo_loras(data_dir: Path, base: Path) -> dict[str, Path]:
    """The two demo adapters (:data:`DEMO_ADAPTERS`, seeds 1 and 2) by name."""
    return {
        name: ensure_demo_lora(data_dir, base, name, DemoLoraSpec(seed=i + 1))
        for i, name in enumerate(DEMO_ADAPTERS)
    }
