"""A host other than loopback with no API keys is refused at start unless asked for by
name (``--allow-anonymous``, ``allow_anonymous``, ``VCACHE_ALLOW_ANONYMOUS``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway import cli
from gateway.cli import anonymous_bind_refusal, is_loopback, main
from gateway.core.config import Settings, hash_api_key

LOOPBACK = ["127.0.0.1", "127.8.9.10", "::1", "[::1]", "localhost", "LOCALHOST", "::ffff:127.0.0.1"]
PUBLIC = ["0.0.0.0", "::", "[::]", "192.168.1.20", "10.0.0.5", "fe80::1", "gateway.internal", ""]


@pytest.mark.parametrize("host", LOOPBACK)
def test_loopback_is_allowed_without_keys(host: str) -> None:
    assert is_loopback(host)
    assert anonymous_bind_refusal(host, keyed=False, allow_anonymous=False) is None


@pytest.mark.parametrize("host", PUBLIC)
def test_a_public_host_without_keys_is_refused(host: str) -> None:
    assert not is_loopback(host)
    why = anonymous_bind_refusal(host, keyed=False, allow_anonymous=False)
    assert why is not None and f"refusing to serve {host} with no API keys" in why
    assert "--allow-anonymous" in why and "VCACHE_ALLOW_ANONYMOUS" in why


@pytest.mark.parametrize("host", PUBLIC)
def test_keys_or_allow_anonymous_let_a_public_host_serve(host: str) -> None:
    assert anonymous_bind_refusal(host, keyed=True, allow_anonymous=False) is None
    assert anonymous_bind_refusal(host, keyed=False, allow_anonymous=True) is None


@pytest.fixture
def no_serve(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[str]:
    """``vcache serve`` with nothing started: the settings it would serve are recorded."""
    for name in ("VCACHE_API_KEYS", "VCACHE_ALLOW_ANONYMOUS", "VCACHE_HOST", "VCACHE_CONFIG_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VCACHE_DATA_DIR", str(tmp_path))
    served: list[str] = []

    def serve(settings: Settings, argv: list[str]) -> int:
        served.append(settings.host)
        return 0

    monkeypatch.setattr(cli, "serve", serve)
    return served


def test_serve_on_0000_without_keys_exits_naming_the_flag(
    no_serve: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "--host", "0.0.0.0"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "vcache: refusing to serve 0.0.0.0 with no API keys (anyone who reaches it could "
        "call the gateway): configure api_keys, or pass --allow-anonymous (setting "
        "allow_anonymous, env VCACHE_ALLOW_ANONYMOUS=true) to serve it anonymously"
    )
    assert no_serve == []  # nothing started


def test_serve_on_0000_with_the_flag_the_setting_or_keys(
    no_serve: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(["serve", "--host", "0.0.0.0", "--allow-anonymous"]) == 0
    monkeypatch.setenv("VCACHE_ALLOW_ANONYMOUS", "true")
    assert main(["serve", "--host", "::"]) == 0
    monkeypatch.delenv("VCACHE_ALLOW_ANONYMOUS")
    monkeypatch.setenv("VCACHE_API_KEYS", json.dumps([{"sha256": hash_api_key("sk-x")}]))
    assert main(["serve", "--host", "0.0.0.0"]) == 0
    assert main(["serve"]) == 0  # 127.0.0.1 by default
    assert no_serve == ["0.0.0.0", "::", "0.0.0.0", "127.0.0.1"]
