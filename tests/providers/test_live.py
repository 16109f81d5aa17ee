"""Live checks against the real providers; each runs only when its API key is set.

``ANTHROPIC_API_KEY``, ``OPENAI_API_KEY``, ``GEMINI_API_KEY``, ``DEEPSEEK_API_KEY``;
the model can be overridden with ``VCACHE_LIVE_<PROVIDER>_MODEL``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from engines.fake import FakeEngine
from engines.providers.specs import PROVIDERS
from engines.tokenizer import ChatTokenizer
from gateway.app import create_app
from gateway.core.config import ApiKeyConfig, hash_api_key
from tests.providers.conftest import KEY, MODELS
from tests.settings import gateway_settings

ANCHOR = "You answer questions about the vcache test manual.\n" * 150


@pytest.fixture(scope="module")
def live_http(demo_model: Path) -> Iterator[TestClient]:
    configured: dict[str, Any] = {p: {} for p in MODELS if os.environ.get(PROVIDERS[p].key_env)}
    if not configured:
        pytest.skip("no provider API key is set")
    settings = gateway_settings(
        grpc_port=None,
        api_keys=[ApiKeyConfig(sha256=hash_api_key(KEY), tenant="live", admin=True)],
        providers=configured,
    )
    engine = FakeEngine(ChatTokenizer.from_pretrained(str(demo_model)))
    with TestClient(create_app(settings, [engine])) as http:
        yield http


@pytest.mark.parametrize("provider", list(MODELS))
def test_live_provider_round_trip(live_http: TestClient, provider: str) -> None:
    if not os.environ.get(PROVIDERS[provider].key_env):
        pytest.skip(f"{PROVIDERS[provider].key_env} is not set")
    model = os.environ.get(f"VCACHE_LIVE_{provider.upper()}_MODEL", MODELS[provider])
    usages = []
    for q in ("What is this manual about?", "Answer in one word: is it a test?"):
        r = live_http.post(
            "/v1/chat/completions",
            headers={"authorization": f"Bearer {KEY}"},
            json={
                "model": f"{provider}/{model}",
                "messages": [{"role": "system", "content": ANCHOR}, {"role": "user", "content": q}],
                "max_tokens": 16,
            },
        )
        assert r.status_code == 200, r.text
        usages.append(r.json()["usage"])
    assert all(u["prompt_tokens"] > 0 for u in usages)
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] >= 0
