"""The session log on the real engine: Responses API turns, and every request of the
integration session rebuilt offline (this file runs last: pytest takes files in order)."""

from __future__ import annotations

import hashlib
import itertools
from pathlib import Path

import pytest

from engines.providers.specs import adapter_for
from engines.tokenizer import ChatTokenizer
from gateway.sessions.log import SessionLog
from gateway.sessions.reconstruct import Reconstructor
from gateway.sessions.store import SessionStore
from tests.integration.conftest import KEY_A, Gateway

pytestmark = pytest.mark.integration

INSTRUCTIONS = "You are the assistant of the vcache operations manual. " * 40


def test_responses_turns_extend_the_prefix_and_cached_tokens_grow(gateway: Gateway) -> None:
    client = gateway.client(KEY_A)
    prev: str | None = None
    cached, prompt = [], []
    for q in ("What is a vBlock?", "How is it pinned?", "When is it evicted?", "Who warms it?"):
        r = client.responses.create(
            model=gateway.model,
            instructions=INSTRUCTIONS,
            input=q,
            previous_response_id=prev,
            max_output_tokens=160,
            extra_body={"ignore_eos": True},
        )
        assert r.usage is not None
        cached.append(r.usage.input_tokens_details.cached_tokens)
        prompt.append(r.usage.input_tokens)
        prev = r.id
    print(f"\nresponses turns: prompt {prompt}, cached {cached}")
    assert cached[0] == 0
    assert all(b > a for a, b in itertools.pairwise(cached))  # grows every turn
    assert all(c % 128 == 0 for c in cached)  # whole KV blocks
    assert prev is not None
    assert client.responses.retrieve(prev).previous_response_id is not None


def test_every_request_of_the_session_rebuilds_offline(gateway: Gateway, demo_model: Path) -> None:
    store = SessionStore(gateway.sessions_db)
    tokenizer = ChatTokenizer.from_pretrained(str(demo_model))
    log = SessionLog(store, Reconstructor(adapter_for, lambda: tokenizer), verify=False)
    rows = store.requests()
    assert len(rows) > 50
    for row in rows:
        event, data = log.rebuild(row.session_id, row.seq)
        assert hashlib.sha256(data).hexdigest() == row.sha256 == event.sha256, row.request_id
    sessions = store.sessions()
    print(f"\n{len(rows)} requests in {len(sessions)} sessions rebuilt byte for byte")
    assert "does not rebuild from the log" not in gateway.log_path.read_text()
    store.close()
