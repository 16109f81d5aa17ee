"""Config precedence: flags > environment > YAML > defaults, merged per nested field."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway.cli import _parser, overrides_from_flags
from gateway.core.config import DEMO_MODEL_NAME, Settings, hash_api_key


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("VCACHE_"):
            monkeypatch.delenv(name)


def _yaml(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "vcache.yaml"
    p.write_text(text)
    return p


def test_defaults() -> None:
    s = Settings()
    assert (s.host, s.port, s.model, s.model_name) == ("127.0.0.1", 8000, None, DEMO_MODEL_NAME)
    assert s.engine.max_model_len == 2048
    assert s.engine.hash_seed == "0"
    assert s.api_keys == []


def test_yaml_then_env_then_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _yaml(
        tmp_path,
        "port: 9000\nhost: 0.0.0.0\nmodel: /models/a\n"
        "engine:\n  max_model_len: 4096\n  block_size: 32\n  hash_seed: '7'\n",
    )
    s = Settings(config_file=cfg)
    assert (s.port, s.host, s.model) == (9000, "0.0.0.0", "/models/a")
    assert (s.engine.max_model_len, s.engine.block_size, s.engine.hash_seed) == (4096, 32, "7")

    monkeypatch.setenv("VCACHE_PORT", "9100")
    monkeypatch.setenv("VCACHE_ENGINE__BLOCK_SIZE", "64")
    s = Settings(config_file=cfg)
    assert s.port == 9100  # env beats YAML
    assert s.engine.block_size == 64  # nested env beats nested YAML ...
    assert s.engine.max_model_len == 4096  # ... without dropping YAML's other engine fields
    assert s.host == "0.0.0.0"

    ns = _parser().parse_args(
        ["serve", "--config", str(cfg), "--port", "9200", "--max-model-len", "1024"]
    )
    s = Settings(**overrides_from_flags(ns))
    assert s.port == 9200  # flag beats env
    assert s.engine.max_model_len == 1024  # nested flag beats YAML
    assert s.engine.block_size == 64  # env still applies beneath the flags
    assert s.engine.hash_seed == "7"  # YAML still applies beneath both


def test_config_file_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _yaml(tmp_path, "served_model_name: house-model\n")
    monkeypatch.setenv("VCACHE_CONFIG_FILE", str(cfg))
    assert Settings().model_name == "house-model"


def test_absent_flags_do_not_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VCACHE_PORT", "9300")
    ns = _parser().parse_args(["serve"])
    assert overrides_from_flags(ns) == {}
    assert Settings(**overrides_from_flags(ns)).port == 9300


def test_enforce_eager_flag_both_ways() -> None:
    on = overrides_from_flags(_parser().parse_args(["serve", "--enforce-eager"]))
    off = overrides_from_flags(_parser().parse_args(["serve", "--no-enforce-eager"]))
    assert Settings(**on).engine.enforce_eager is True
    assert Settings(**off).engine.enforce_eager is False


def test_api_keys_from_env_json(monkeypatch: pytest.MonkeyPatch) -> None:
    digest = hash_api_key("sk-one")
    monkeypatch.setenv("VCACHE_API_KEYS", f'[{{"sha256": "{digest}", "tenant": "acme"}}]')
    s = Settings()
    assert [(k.sha256, k.tenant) for k in s.api_keys] == [(digest, "acme")]


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("port: 70000\n", "port"),
        ("engine:\n  max_model_len: 4\n", "max_model_len"),
        ("api_keys:\n  - sha256: not-a-hash\n", "sha256"),
        ("no_such_option: 1\n", "no_such_option"),
    ],
)
def test_invalid_config_names_the_field(tmp_path: Path, text: str, field: str) -> None:
    with pytest.raises(ValidationError) as err:
        Settings(config_file=_yaml(tmp_path, text))
    assert field in str(err.value)


def test_example_config_is_valid() -> None:
    example = Path(__file__).resolve().parents[3] / "deploy" / "vcache.example.yaml"
    s = Settings(config_file=example)
    assert s.config_file == example
    assert s.engine.hash_seed == "0"


def test_a_typo_names_the_key_and_the_nearest_valid_one(tmp_path: Path) -> None:
    from pydantic import ValidationError

    from gateway.core.config import explain

    cfg = tmp_path / "vcache.yaml"
    cfg.write_text("engine:\n  max_modle_len: 1024\ncahce:\n  routing: kv\n")
    with pytest.raises(ValidationError) as info:
        Settings(config_file=cfg)
    assert explain(info.value) == [
        "unknown setting 'engine.max_modle_len' (did you mean 'engine.max_model_len'?)",
        "unknown setting 'cahce' (did you mean 'cache'?)",
    ]


def test_an_environment_typo_is_named(tmp_path: Path) -> None:
    from gateway.core.config import unknown_env

    env = {
        "VCACHE_ENGINE__REPLICAZ": "2",  # a typo
        "VCACHE_ENGINE__REPLICAS": "2",  # fine
        "VCACHE_PROVIDERS__OPENAI__API_KEY": "x",  # a free-form section
        "VCACHE_CONTROL_SECRET": "s",  # not a setting (the engine plugin's)
    }
    assert unknown_env(env) == [
        "unknown setting VCACHE_ENGINE__REPLICAZ (did you mean VCACHE_ENGINE__REPLICAS?)"
    ]


def test_serve_refuses_a_bad_config_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gateway.cli import main

    cfg = tmp_path / "vcache.yaml"
    cfg.write_text("cache:\n  routnig: kv\n")
    with pytest.raises(SystemExit) as info:
        main(["serve", "--config", str(cfg)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert (
        "invalid configuration" in err and "'cache.routnig' (did you mean 'cache.routing'?)" in err
    )
