"""The admin key of the gateways the load tests start (loadtests/admin_key.py): the setting
they start a gateway with makes its key a global admin, so the cache API and the routing
headers the load tests use answer, and the scripts that use them send it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from engines.fake import FakeEngine
from engines.tokenizer import ChatTokenizer
from gateway.app import create_app
from gateway.core.config import Settings
from gateway.service.auth import KeyRing
from loadtests import routing_pressure
from loadtests.admin_key import ADMIN_KEY, admin_env, bearer, locust_env
from loadtests.agent_arm import ADMIN_KEY as AGENTS_KEY
from loadtests.agent_arm import BACKGROUND_KEY, _keys
from tests.settings import gateway_settings

MODEL = "vcache-demo"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _settings(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> Settings:
    """Settings as a gateway started with ``env`` reads them."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return Settings()


def test_the_gateway_reads_the_key_as_a_global_admin_of_the_default_tenant(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = _settings(monkeypatch, admin_env())
    ring = KeyRing(settings.api_keys)
    who = ring.authenticate(bearer()["Authorization"])
    assert who.admin and who.global_admin and who.tenant == "default"
    assert locust_env() == {"VCACHE_API_KEY": ADMIN_KEY}
    # the agent-sessions benchmark's keys: its agents an admin of their own tenant
    ring = KeyRing(_settings(monkeypatch, _keys("interactive")).api_keys)
    agents = ring.authenticate(bearer(AGENTS_KEY)["Authorization"])
    assert (agents.tenant, agents.admin, agents.global_admin) == ("agents", True, False)
    assert agents.priority == "interactive"
    bg = ring.authenticate(bearer(BACKGROUND_KEY)["Authorization"])
    assert (bg.tenant, bg.admin) == ("background", False)


@pytest.fixture(scope="module")
def client(demo_model: Path) -> Iterator[TestClient]:
    with pytest.MonkeyPatch.context() as mp:
        keys = _settings(mp, admin_env()).api_keys
    engine = FakeEngine(ChatTokenizer.from_pretrained(str(demo_model)), max_model_len=512)
    app = create_app(gateway_settings(grpc_port=None, api_keys=keys), [engine])
    with TestClient(app) as c:
        yield c


def test_the_admin_routes_and_headers_answer_the_key(client: TestClient) -> None:
    assert client.get("/v1/cache/plan", headers=bearer()).status_code == 200
    assert client.get("/v1/cache/plan").status_code == 401  # keys configured: one is needed
    for header, value in (("x-vcache-routing", "round_robin"), ("x-vcache-replica", "replica-0")):
        r = client.post("/v1/chat/completions", json=CHAT, headers={**bearer(), header: value})
        assert r.status_code == 200, (header, r.text)


@pytest.mark.parametrize("arm", routing_pressure.VCACHE_ARMS)
def test_every_routing_pressure_arm_sends_the_admin_key(arm: str) -> None:
    env = routing_pressure.arm_env(arm)
    assert env["VCACHE_API_KEY"] == ADMIN_KEY
    assert ("VCACHE_ORACLE_REPLICAS" in env) == (arm == "oracle")
    assert env.get("VCACHE_ROUTING") == (None if arm == "oracle" else arm)
