"""The provider emulator on loopback, and an in-process gateway whose providers point at it.

The emulator runs as its own process (``python -m loadtests.emulator``), as
a user would run it; the gateway runs in-process over a fake local engine
(these tests are about the provider path), driven through the official
``openai`` client.  The gateway's provider clock is a :class:`FakeClock`.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from engines.fake import FakeEngine
from engines.tokenizer import ChatTokenizer
from gateway.app import create_app
from gateway.core.config import ApiKeyConfig, Settings, hash_api_key
from gateway.providers.control import Control
from gateway.providers.path import ProviderPath
from gateway.sessions.log import SessionLog
from tests.integration.conftest import _free_port, running

KEY = "sk-provider-tests"
LOCAL = "vcache-demo"
PROVIDER_KEY = "emulator-key"
MODELS = {
    "anthropic": "claude-sonnet-4-5",
    "openai": "gpt-5",
    "gemini": "gemini-2.5-flash",
    "deepseek": "deepseek-chat",
}


# a system prompt long enough for every provider's minimum cacheable prefix
MANUAL = "You answer questions about the vcache manual, section by section.\n" * 100


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Emulator:
    url: str

    def admin(self, path: str, **body: Any) -> Any:
        r = httpx.post(f"{self.url}/admin/{path}", json=body, timeout=10)
        r.raise_for_status()
        return r.json()

    def admin_get(self, path: str) -> Any:
        r = httpx.get(f"{self.url}/admin/{path}", timeout=10)
        r.raise_for_status()
        return r.json()

    def received(self) -> list[dict[str, Any]]:
        return list(httpx.get(f"{self.url}/admin/requests", timeout=10).json())

    def last_body(self) -> Any:
        """The last request the emulator received, decoded."""
        return httpx.get(f"{self.url}/admin/requests/last", timeout=10).json()

    def base_url(self, provider: str) -> str:
        return {
            "anthropic": f"{self.url}/v1",
            "openai": f"{self.url}/v1",
            "gemini": f"{self.url}/v1beta",
            "deepseek": f"{self.url}/deepseek",
        }[provider]


@pytest.fixture(scope="session")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    port = _free_port()
    log = tmp_path_factory.mktemp("emulator") / "emulator.log"
    repo = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "loadtests.emulator", "--port", str(port)]
    cmd += ["--api-key", PROVIDER_KEY]
    url = f"http://127.0.0.1:{port}"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(repo)}
    with running(cmd, env, f"{url}/admin/requests", log, "emulator"):
        yield Emulator(url)


@dataclass
class Gw:
    http: TestClient
    clock: FakeClock
    path: ProviderPath
    engine: FakeEngine
    emulator: Emulator

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url="http://testserver/v1", api_key=KEY, http_client=self.http, max_retries=0
        )

    def log(self) -> SessionLog:
        """The gateway's session log."""
        log: SessionLog = self.http.app.state.session_log  # type: ignore[attr-defined]
        return log

    def control(self) -> Control:
        """The gateway's provider control loop."""
        c: Control = self.http.app.state.control  # type: ignore[attr-defined]
        return c

    def ask(self, model: str, question: str = "what is a block?", system: str = MANUAL) -> Any:
        """A short chat on ``model`` under ``system``; its usage (a 200 or the test fails)."""
        r = self.http.post(
            "/v1/chat/completions",
            headers={"authorization": f"Bearer {KEY}"},
            json={
                "model": model,
                "max_tokens": 4,
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": question},
                ],
            },
        )
        assert r.status_code == 200, r.text
        return r.json()["usage"]

    def stats(self) -> dict[str, Any]:
        r = self.http.get("/v1/cache/stats", headers={"authorization": f"Bearer {KEY}"})
        assert r.status_code == 200, r.text
        out: dict[str, Any] = r.json()["providers"]
        return out


@pytest.fixture(scope="module")
def tokenizer(demo_model: Path) -> ChatTokenizer:
    return ChatTokenizer.from_pretrained(str(demo_model))


def provider_settings(emulator: Emulator, **overrides: Any) -> Settings:
    providers = {
        p: {
            "base_url": emulator.base_url(p),
            "api_key": PROVIDER_KEY,
            "backoff_base_s": 0.05,
            "backoff_cap_s": 0.2,
        }
        for p in MODELS
    }
    values: dict[str, Any] = {
        "grpc_port": None,
        "api_keys": [ApiKeyConfig(sha256=hash_api_key(KEY), tenant="t", admin=True)],
        "providers": providers,
        "aliases": {"smart": ["local", "anthropic/claude-sonnet-4-5"]},
    }
    values.update(overrides)
    return Settings(**values)


@pytest.fixture
def gw(emulator: Emulator, tokenizer: ChatTokenizer) -> Iterator[Gw]:
    emulator.admin("reset")
    yield from make_gateway(emulator, tokenizer)


def make_gateway(emulator: Emulator, tokenizer: ChatTokenizer, **overrides: Any) -> Iterator[Gw]:
    db = Path(tempfile.mkdtemp(prefix="vcache-sessions-")) / "sessions.db"
    overrides.setdefault("session_log", {"path": str(db), "verify_reconstruction": True})
    settings = provider_settings(emulator, **overrides)
    clock = FakeClock()
    engine = FakeEngine(tokenizer, block_size=16, max_model_len=512)
    app = create_app(settings, [engine], provider_clock=clock)
    with TestClient(app) as http:
        yield Gw(http, clock, app.state.providers, engine, emulator)
