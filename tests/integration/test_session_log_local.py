"""The session log on the real engine: Responses API turns, and every request sent so
far rebuilt offline (the gateway fixture's teardown rebuilds the whole session's, in
whatever order the tests ran)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from tests.integration.conftest import KEY_A, Gateway, rebuild_all

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


def test_every_request_so_far_rebuilds_offline(gateway: Gateway, demo_model: Path) -> None:
    client = gateway.client(KEY_A)
    for i in range(3):  # requests of its own, so the check never depends on test order
        client.chat.completions.create(
            model=gateway.model,
            messages=[
                {"role": "system", "content": INSTRUCTIONS},
                {"role": "user", "content": f"question {i}"},
            ],
            max_tokens=4,
        )
    rebuilt, failed = rebuild_all(gateway.sessions_db, demo_model)
    print(f"\n{rebuilt} requests rebuilt byte for byte")
    assert failed == [] and rebuilt >= 3
    assert "does not rebuild from the log" not in gateway.log_path.read_text()
