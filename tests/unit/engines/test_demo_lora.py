"""The demo LoRA adapters: PEFT's format with the base model's shapes, one seed one set
of bytes, two seeds two adapters (no engine is started here)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file

from engines.vllm.demo_lora import DEMO_ADAPTERS, DemoLoraSpec, ensure_demo_lora, ensure_demo_loras

BASE = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def _base(tmp_path: Path) -> Path:
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps(BASE))
    return base


def test_an_adapter_has_peft_files_with_the_base_models_shapes(tmp_path: Path) -> None:
    base = _base(tmp_path)
    out = ensure_demo_lora(tmp_path / "data", base, "a", DemoLoraSpec(seed=1, rank=4))
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4
    assert config["target_modules"] == ["q_proj", "v_proj"]
    tensors = load_file(str(out / "adapter_model.safetensors"))
    assert len(tensors) == 2 * 2 * 2  # layers x (q, v) x (A, B)
    p = "base_model.model.model.layers.1.self_attn"
    assert tuple(tensors[f"{p}.q_proj.lora_A.weight"].shape) == (4, 32)
    assert tuple(tensors[f"{p}.q_proj.lora_B.weight"].shape) == (32, 4)  # 4 heads x 8
    assert tuple(tensors[f"{p}.v_proj.lora_B.weight"].shape) == (16, 4)  # 2 kv heads x 8


def test_one_seed_is_built_once_and_two_seeds_differ(tmp_path: Path) -> None:
    base = _base(tmp_path)
    data = tmp_path / "data"
    first = ensure_demo_lora(data, base, "a", DemoLoraSpec(seed=1))
    stamp = (first / "adapter_model.safetensors").stat().st_mtime_ns
    again = ensure_demo_lora(data, base, "a", DemoLoraSpec(seed=1))
    assert again == first and (again / "adapter_model.safetensors").stat().st_mtime_ns == stamp
    both = ensure_demo_loras(data, base)
    assert list(both) == list(DEMO_ADAPTERS)
    a, b = (both[n] / "adapter_model.safetensors" for n in DEMO_ADAPTERS)
    assert a.read_bytes() != b.read_bytes()
    assert not [p for p in (data / "loras").iterdir() if p.name.startswith(".building-")]
