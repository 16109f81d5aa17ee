"""OpenAI's extended prompt caching: ``prompt_cache_retention: 24h`` from the config to
the wire, kept past the in-memory TTL, and rebuilt from the session log."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import pytest

from engines.tokenizer import ChatTokenizer
from tests.providers.conftest import KEY, MODELS, PROVIDER_KEY, Emulator, Gw, make_gateway

SYSTEM = "You answer questions about the vcache manual, one section at a time.\n" * 80


@pytest.fixture
def retained(emulator: Emulator, tokenizer: ChatTokenizer) -> Iterator[Gw]:
    emulator.admin("reset")
    openai = {
        "base_url": emulator.base_url("openai"),
        "api_key": PROVIDER_KEY,
        "prompt_cache_retention": "24h",
        "belief_ttl_s": 86400,
    }
    yield from make_gateway(emulator, tokenizer, providers={"openai": openai}, aliases={})


def _ask(gw: Gw, q: str) -> Any:
    r = gw.http.post(
        "/v1/chat/completions",
        headers={"authorization": f"Bearer {KEY}", "x-vcache-session": "retained"},
        json={
            "model": f"openai/{MODELS['openai']}",
            "max_tokens": 4,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
        },
    )
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_extended_retention_goes_on_the_wire_and_outlives_the_in_memory_ttl(
    retained: Gw,
) -> None:
    assert _ask(retained, "first") == 0
    assert retained.emulator.last_body()["prompt_cache_retention"] == "24h"
    retained.emulator.admin("clock/advance", seconds=3 * 3600)  # hours, not minutes
    retained.clock.now += 3 * 3600
    assert _ask(retained, "second") >= 1024
    log = retained.log()
    for row in log.store.requests():
        _, data = log.rebuild(row.session_id, row.seq)
        assert hashlib.sha256(data).hexdigest() == row.sha256
