"""The provider emulator, and an in-process gateway whose providers point at it.

``emulator``: the emulator's app in this process, reached through the provider
client's transport seam (:class:`~engines.providers.transport.AsgiTransport`:
the same client, retries and stream parsing, no socket and no subprocess).
``emulator_server``: the emulator as its own process on loopback
(``python -m loadtests.emulator``, as a user runs it), for what runs in
processes of its own (the CLI, worker gateways).  The gateway runs in-process
over a fake local engine (these tests are about the provider path), driven
through the official ``openai`` client.  Its provider clock is a
:class:`FakeClock`.
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
from engines.providers.transport import AsgiTransport, Transport
from engines.tokenizer import ChatTokenizer
from gateway.app import create_app
from gateway.core.config import ApiKeyConfig, Settings, hash_api_key
from gateway.providers.control import Control
from gateway.providers.path import ProviderPath
from gateway.sessions.log import SessionLog
from loadtests.emulator.app import create_app as emulator_app
from loadtests.emulator.state import EmulatorState
from tests.integration.conftest import _free_port, running
from tests.settings import gateway_settings

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
    http: httpx.Client | TestClient  # its admin API
    transport: Transport | None = None  # in-process: how a gateway reaches it

    def admin(self, path: str, **body: Any) -> Any:
        r = self.http.post(f"{self.url}/admin/{path}", json=body)
        r.raise_for_status()
        return r.json()

    def admin_get(self, path: str) -> Any:
        r = self.http.get(f"{self.url}/admin/{path}")
        r.raise_for_status()
        return r.json()

    def received(self) -> list[dict[str, Any]]:
        return list(self.admin_get("requests"))

    def last_body(self) -> Any:
        """The last request the emulator received, decoded."""
        return self.admin_get("requests/last")

    def base_url(self, provider: str) -> str:
        return {
            "anthropic": f"{self.url}/v1",
            "openai": f"{self.url}/v1",
            "gemini": f"{self.url}/v1beta",
            "deepseek": f"{self.url}/deepseek",
        }[provider]


@pytest.fixture(scope="session")
def emulator() -> Iterator[Emulator]:
    """The emulator's app in this process (its admin API through a test client)."""
    app = emulator_app(EmulatorState(api_key=PROVIDER_KEY))
    url = "http://emulator.test"
    with TestClient(app, base_url=url) as admin:
        yield Emulator(url, admin, AsgiTransport(app))


@pytest.fixture(scope="session")
def emulator_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    """The emulator as its own process on loopback."""
    port = _free_port()
    log = tmp_path_factory.mktemp("emulator") / "emulator.log"
    repo = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "loadtests.emulator", "--port", str(port)]
    cmd += ["--api-key", PROVIDER_KEY]
    url = f"http://127.0.0.1:{port}"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(repo)}
    with (
        running(cmd, env, f"{url}/admin/requests", log, "emulator"),
        httpx.Client(timeout=10) as admin,
    ):
        yield Emulator(url, admin)


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
        return self.chat(model, question, system).json()["usage"]

    def chat(self, model: str, question: str, system: str = MANUAL) -> Any:
        """A short chat on ``model`` under ``system``, answered 200 (or the test fails)."""
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
        return r

    def advance(self, seconds: float) -> None:
        """Move both clocks together: the gateway's provider clock and the emulator's."""
        self.clock.now += seconds
        self.emulator.admin("clock/advance", seconds=seconds)

    def tick(self) -> int:
        """One control-loop tick, run by hand; how many anchors it heartbeated."""
        send = self.http.app.state.service.warm_provider  # type: ignore[attr-defined]
        return len(self.http.portal.call(self.control().tick, send))  # type: ignore[union-attr]

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
    return gateway_settings(**values)


@pytest.fixture
def gw(emulator: Emulator, tokenizer: ChatTokenizer) -> Iterator[Gw]:
    emulator.admin("reset")
    yield from make_gateway(emulator, tokenizer)


def controlled(
    emulator: Emulator, tokenizer: ChatTokenizer, mode: str, fan_wait_s: float = 5
) -> Iterator[Gw]:
    """A gateway whose control loop runs in ``mode``, each tick by hand."""
    emulator.admin("reset")
    control = {"mode": mode, "tick_s": 3600, "fan_wait_s": fan_wait_s}
    yield from make_gateway(emulator, tokenizer, control=control)


@pytest.fixture
def governed(emulator: Emulator, tokenizer: ChatTokenizer) -> Iterator[Gw]:
    """A gateway whose control loop governs (``control.mode: govern``)."""
    yield from controlled(emulator, tokenizer, "govern")


def make_gateway(
    emulator: Emulator, tokenizer: ChatTokenizer, max_model_len: int = 512, **overrides: Any
) -> Iterator[Gw]:
    db = Path(tempfile.mkdtemp(prefix="vcache-sessions-")) / "sessions.db"
    overrides.setdefault("session_log", {"path": str(db), "verify_reconstruction": True})
    settings = provider_settings(emulator, **overrides)
    clock = FakeClock()
    engine = FakeEngine(tokenizer, block_size=16, max_model_len=max_model_len)
    app = create_app(
        settings, [engine], provider_clock=clock, provider_transport=emulator.transport
    )
    with TestClient(app) as http:
        yield Gw(http, clock, app.state.providers, engine, emulator)
