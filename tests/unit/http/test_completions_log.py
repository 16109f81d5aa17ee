"""Text completions are in the session log and rebuild byte for byte from it.

Each prompt of a request is an engine request of its own (the first under the
response's id, prompt i under ``<id>-p<i>``): journaled before it is sent (the
gateway verifies the rebuild, as ``tests/settings.py`` sets it), its prompt the
one entry of its conversation (``prompt`` as text, ``prompt_tokens`` as ids), its
answer appended.  Here the log is read again offline, as ``vcache replay`` reads
it (a tokenizer of its own), and each rebuilt request is compared with what the
engine was handed."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from engines.base import GenerateRequest
from engines.fake import FakeEngine
from engines.providers.specs import adapter_for
from gateway.sessions.log import SessionLog
from gateway.sessions.reconstruct import Reconstructor
from gateway.sessions.render import vllm_payload
from gateway.sessions.store import SessionStore
from manifest.sessionlog import DispatchEvent, MessageEvent, ResponseEvent, fold, session_name

MODEL = "vcache-demo"


def _sent(g: GenerateRequest) -> bytes:
    """What the engine was handed, as the session log records it."""
    return vllm_payload(g.prompt_token_ids, g.cache_salt, dataclasses.asdict(g.sampling))


def _ask(http: TestClient, body: dict[str, Any]) -> tuple[str, dict[str, str]]:
    """The response id and headers of a completion (whole or streamed)."""
    body = {"model": MODEL, "max_tokens": 3, **body}
    if not body.get("stream"):
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return str(r.json()["id"]), dict(r.headers)
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        return str(events[0]["id"]), dict(r.headers)


CASES = {
    "one text prompt, whole": {"prompt": "a single prompt to log"},
    "one text prompt, streamed": {"prompt": "a streamed prompt", "stream": True},
    "text prompts, whole, n=2, echo": {
        "prompt": ["the first of three", "a second", "and the third prompt"],
        "n": 2,
        "echo": True,
    },
    "token prompts, streamed": {"prompt": [[5, 6, 7, 8], [9, 10]], "stream": True},
    "one token prompt, truncated": {"prompt": list(range(5, 40)), "truncate_prompt_tokens": 9},
    "text without special tokens, truncated on the right": {
        "prompt": ["one two three four five six seven", "eight nine ten eleven"],
        "add_special_tokens": False,
        "truncate_prompt_tokens": 4,
        "truncation_side": "right",
        "temperature": 0.3,
        "seed": 7,
    },
}


@pytest.mark.parametrize("body", list(CASES.values()), ids=list(CASES))
def test_each_prompt_is_journaled_and_rebuilds_byte_for_byte(
    gw: tuple[FakeEngine, TestClient], body: dict[str, Any]
) -> None:
    engine, http = gw
    live: SessionLog = http.app.state.session_log  # type: ignore[attr-defined]
    before, verified = len(engine.received), live.verified
    rid, headers = _ask(http, body)
    sent = engine.received[before:]
    p = body["prompt"]
    prompts = len(p) if isinstance(p, list) and isinstance(p[0], str | list) else 1
    ids = [rid] + [f"{rid}-p{i}" for i in range(1, prompts)]
    assert sorted(g.request_id for g in sent) == sorted(ids)  # one engine request each
    assert live.verified == verified + prompts  # each rebuilt before it was sent
    first = live.store.request(rid)  # the headers are the first prompt's
    assert first is not None and headers["x-vcache-session"] == session_name(first.session_id)
    assert headers["x-vcache-replica"] == "replica-0"

    # offline, as `vcache replay` does: the store and a tokenizer of its own
    store = SessionStore(live.store.path)
    replay = SessionLog(store, Reconstructor(adapter_for, lambda: engine.tokenizer), verify=False)
    try:
        for g in sent:
            row = store.request(g.request_id)
            assert row is not None and row.target == "local"
            event, rebuilt = replay.rebuild(row.session_id, row.seq)
            assert rebuilt == _sent(g)  # byte for byte what the engine was handed
            assert hashlib.sha256(rebuilt).hexdigest() == row.sha256 == event.sha256
            events = [e for _, e in store.events(row.session_id)]
            state = fold(events[: events.index(event)])
            assert state.header is not None
            assert state.header.settings()["endpoint"] == "completions"
            assert [m.role for m in state.messages] in (["prompt"], ["prompt_tokens"])
            # the answer follows: its text and usage
            after = events[events.index(event) + 1 :]
            assert any(isinstance(e, MessageEvent) and e.role == "assistant" for e in after)
            answered = [e for e in after if isinstance(e, ResponseEvent)]
            assert g.request_id in [e.request_id for e in answered]
            assert isinstance(event, DispatchEvent) and "prompt" in event.settings()
    finally:
        store.close()


def test_a_prompt_refused_leaves_nothing_in_the_log(gw: tuple[FakeEngine, TestClient]) -> None:
    engine, http = gw
    live: SessionLog = http.app.state.session_log  # type: ignore[attr-defined]
    logged, before = len(live.store.requests()), len(engine.received)
    body = {"model": MODEL, "prompt": ["fine", "also fine", ""], "max_tokens": 2}
    r = http.post("/v1/completions", json=body)
    assert (r.status_code, r.json()["error"]["param"]) == (400, "prompt[2]")
    assert len(live.store.requests()) == logged and len(engine.received) == before
