"""The Responses API: state from the session log, each turn extending the last."""

from __future__ import annotations

import hashlib
import itertools

import openai
import pytest

from gateway.sessions.log import SessionLog
from tests.providers.conftest import KEY, MODELS, Gw

INSTRUCTIONS = "You are the vcache manual's assistant. Cite sections.\n" * 100


def test_previous_response_id_chains_turns_and_cached_tokens_grow(gw: Gw) -> None:
    client = gw.client()
    first = client.responses.create(
        model="vcache-demo",
        input="What is a vBlock?",
        instructions="Be brief.",
        max_output_tokens=8,
    )
    assert first.object == "response" and first.status in ("completed", "incomplete")
    assert first.output_text
    cached = [first.usage.input_tokens_details.cached_tokens if first.usage else -1]
    prev = first
    for q in ("And a pin?", "And a lease?", "And an anchor?"):
        nxt = client.responses.create(
            model="vcache-demo",
            input=q,
            instructions="Be brief.",
            previous_response_id=prev.id,
            max_output_tokens=8,
        )
        assert nxt.previous_response_id == prev.id
        assert nxt.usage is not None
        cached.append(nxt.usage.input_tokens_details.cached_tokens)
        prev = nxt
    assert cached[0] == 0
    assert cached == sorted(cached) and cached[-1] > cached[1] > 0  # the prefix keeps extending
    # every engine request extends the previous one, token for token
    sent = [g.prompt_token_ids for g in gw.engine.received]
    assert all(b[: len(a)] == a for a, b in itertools.pairwise(sent))
    log: SessionLog = gw.http.app.state.session_log  # type: ignore[attr-defined]
    rows = log.store.requests()
    assert len({r.session_id for r in rows}) == 1 and len(rows) == 4
    for row in rows:
        _, data = log.rebuild(row.session_id, row.seq)
        assert hashlib.sha256(data).hexdigest() == row.sha256


def test_get_and_delete_a_stored_response(gw: Gw) -> None:
    client = gw.client()
    r = client.responses.create(model="vcache-demo", input="hello", max_output_tokens=4)
    again = client.responses.retrieve(r.id)
    assert again.id == r.id and again.output_text == r.output_text
    gw.http.delete(f"/v1/responses/{r.id}", headers={"authorization": f"Bearer {KEY}"})
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model="vcache-demo", input="more", previous_response_id=r.id)
    assert "previous_response_id" in str(info.value.body)
    unstored = client.responses.create(
        model="vcache-demo", input="x", store=False, max_output_tokens=2
    )
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_streamed_responses_on_a_provider_extend_the_anchor(gw: Gw) -> None:
    client = gw.client()
    model = f"anthropic/{MODELS['anthropic']}"
    prev = None
    cached = []
    for q in ("first question", "second question", "third question"):
        stream = client.responses.create(
            model=model,
            input=q,
            instructions=INSTRUCTIONS,
            previous_response_id=prev,
            max_output_tokens=8,
            stream=True,
        )
        kinds, deltas, done = [], [], None
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            if event.type in ("response.completed", "response.incomplete"):
                done = event.response
        assert kinds[0] == "response.created" and kinds[-1] in (
            "response.completed",
            "response.incomplete",
        )
        assert done is not None and done.usage is not None
        assert done.output_text == "".join(deltas)
        cached.append(done.usage.input_tokens_details.cached_tokens)
        prev = done.id
    assert cached[0] == 0 and cached[1] > 0 and cached[2] >= cached[1]


def test_bad_responses_requests_are_400s(gw: Gw) -> None:
    r = gw.http.post(
        "/v1/responses",
        headers={"authorization": f"Bearer {KEY}"},
        json={
            "model": "vcache-demo",
            "input": "x",
            "tools": [{"type": "web_search"}],
            "tool_choice": {"type": "web_search"},
        },
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice.type"
    r = gw.http.post(
        "/v1/responses", headers={"authorization": f"Bearer {KEY}"}, json={"model": "vcache-demo"}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"


def test_concurrent_forks_each_continue_from_their_own_answer(gw: Gw) -> None:
    """Forks of one response answered at once: each stored response points at its own
    answer in the log, so continuing it sees its own question, not a sibling's."""
    from concurrent.futures import ThreadPoolExecutor

    client = gw.client()
    root = client.responses.create(model="vcache-demo", input="root", max_output_tokens=2)

    def fork(i: int) -> str:
        r = client.responses.create(
            model="vcache-demo",
            input=f"fork number {i} zebra{i}",
            previous_response_id=root.id,
            max_output_tokens=2,
        )
        return r.id

    with ThreadPoolExecutor(8) as pool:
        forks = list(pool.map(fork, range(8)))
    for i, fid in enumerate(forks):
        gw.engine.received.clear()
        client.responses.create(
            model="vcache-demo", input="go on", previous_response_id=fid, max_output_tokens=2
        )
        (sent,) = gw.engine.received
        text = gw.engine.tokenizer.decode(list(sent.prompt_token_ids))
        assert f"zebra{i}" in text
        assert [j for j in range(8) if j != i and f"zebra{j}" in text] == []
