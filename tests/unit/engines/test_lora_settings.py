"""engine.lora: what it accepts, and what the embedded engines are started with (no
engine is started here)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from engines.lora import LoraRef
from engines.vllm.engine_config import VllmEngineConfig, engine_args
from gateway.core.engine_settings import LoraSettings
from gateway.local.build import engine_configs
from tests.settings import gateway_settings


def test_lora_reaches_vllms_engine_arguments_only_when_enabled() -> None:
    on = VllmEngineConfig(
        model="m", served_name="s", enable_lora=True, max_loras=3, max_lora_rank=8, max_cpu_loras=5
    )
    args = engine_args(on)
    assert (args.enable_lora, args.max_loras, args.max_lora_rank, args.max_cpu_loras) == (
        True,
        3,
        8,
        5,
    )
    off = engine_args(VllmEngineConfig(model="m", served_name="s", max_loras=3))
    assert not off.enable_lora and off.max_loras != 3


@pytest.mark.parametrize(
    ("values", "why"),
    [
        ({"max_lora_rank": 12}, "max_lora_rank is one of"),
        ({"max_loras": 4, "max_cpu_loras": 2}, "max_cpu_loras is at least"),
        ({"adapters": {"../up": "/x"}}, "pattern"),
        ({"max_loras": 0}, "greater than or equal to 1"),
    ],
)
def test_what_engine_lora_refuses(values: dict[str, object], why: str) -> None:
    with pytest.raises(ValidationError, match=why):
        LoraSettings.model_validate(values)


def test_the_embedded_engines_load_the_configured_adapters_at_start(tmp_path: Path) -> None:
    lora = {"enabled": True, "max_loras": 2, "max_lora_rank": 8, "adapters": {"a": "/loras/a"}}
    settings = gateway_settings(
        model="some/model", engine={"replicas": 2, "placement": "none", "lora": lora}
    )
    configs = engine_configs(settings, tmp_path, "some/model")
    assert len(configs) == 2
    for c in configs:
        assert c.enable_lora and (c.max_loras, c.max_lora_rank) == (2, 8)
        assert c.adapters == (LoraRef("a", "/loras/a"),)
    plain_settings = gateway_settings(model="some/model", engine={"placement": "none"})
    plain = engine_configs(plain_settings, tmp_path, "some/model")
    assert not plain[0].enable_lora and plain[0].adapters == ()


def test_an_adapters_vllm_id_is_its_name_and_path() -> None:
    """The gateway workers attached to one engine core give an adapter the same id (a
    counter per worker would give two adapters one id), another path another id."""
    from engines.vllm.engine import lora_id

    a = LoraRef("a", "/loras/a")
    assert lora_id(a) == lora_id(LoraRef("a", "/loras/a"))
    ids = {lora_id(x) for x in (a, LoraRef("a", "/loras/a2"), LoraRef("b", "/loras/a"))}
    assert len(ids) == 3 and all(0 < i < 2**31 for i in ids)
