"""The session log: every request rebuilt byte-for-byte, checked against what was received."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from manifest.sessionlog import (
    DispatchEvent,
    HeaderEvent,
    Reason,
    ReplaceEvent,
    fold,
    scoped_session,
)
from tests.providers.conftest import KEY, MODELS, Gw

SYSTEM = "You answer questions about the vcache manual.\n" * 40


def converse(
    gw: Gw, model: str, turns: int, headers: dict[str, str] | None = None, system: str = SYSTEM
) -> list[Any]:
    """A stateless client: each request resends the whole conversation so far."""
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    out = []
    for i in range(turns):
        messages.append({"role": "user", "content": f"question {i}: what does section {i} say?"})
        r = gw.http.post(
            "/v1/chat/completions",
            headers={"authorization": f"Bearer {KEY}", **(headers or {})},
            json={"model": model, "messages": messages, "max_tokens": 6},
        )
        assert r.status_code == 200, r.text
        out.append(r)
        messages.append(
            {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]}
        )
    return out


@pytest.mark.parametrize("provider", list(MODELS))
def test_every_provider_request_rebuilds_to_the_bytes_the_emulator_received(
    gw: Gw, provider: str
) -> None:
    model = f"{provider}/{MODELS[provider]}"
    replies = converse(gw, model, 4)
    sessions = {r.headers["x-vcache-session"] for r in replies}
    assert len(sessions) == 1  # the stateless conversation was found again each turn
    log = gw.log()
    assert log.verify and log.verified >= 4
    received = [
        r["sha256"]
        for r in gw.emulator.received()
        if "cachedContents" not in r["path"] or not r["path"].endswith("/cachedContents")
    ]
    received = [
        r["sha256"] for r in gw.emulator.received() if r["path"] != "/v1beta/cachedContents"
    ]
    rows = log.store.requests(scoped_session("t", sessions.pop()))
    assert len(rows) == 4
    rebuilt = []
    for row in rows:
        event, data = log.rebuild(row.session_id, row.seq)
        assert hashlib.sha256(data).hexdigest() == row.sha256 == event.sha256
        rebuilt.append(row.sha256)
    assert rebuilt == received  # byte for byte what reached the provider, in order


def test_local_requests_rebuild_to_the_token_ids_the_engine_received(gw: Gw) -> None:
    replies = converse(gw, "vcache-demo", 3, system="You are brief.")
    sid = replies[0].headers["x-vcache-session"]
    assert {r.headers["x-vcache-session"] for r in replies} == {sid}
    log = gw.log()
    rows = log.store.requests(scoped_session("t", sid))
    assert [r.request_id for r in rows] == [g.request_id for g in gw.engine.received]
    import json

    for row, greq in zip(rows, gw.engine.received, strict=True):
        _, data = log.rebuild(row.session_id, row.seq)
        payload = json.loads(data)
        assert payload["prompt_token_ids"] == list(greq.prompt_token_ids)
        assert payload["cache_salt"] == greq.cache_salt
        assert payload["sampling"]["max_tokens"] == greq.sampling.max_tokens


def test_an_explicit_session_logs_a_change_snapshot_and_still_rebuilds(gw: Gw) -> None:
    model = f"anthropic/{MODELS['anthropic']}"
    h = {"x-vcache-session": "team-a.chat-1"}
    converse(gw, model, 2, h)
    r = gw.http.post(  # the same conversation, now with another system prompt
        "/v1/chat/completions",
        headers={"authorization": f"Bearer {KEY}", **h},
        json={
            "model": model,
            "messages": [
                {"role": "system", "content": SYSTEM + "Answer in French.\n"},
                {"role": "user", "content": "question 0: what does section 0 say?"},
            ],
            "max_tokens": 6,
        },
    )
    assert r.status_code == 200 and r.headers["x-vcache-session"] == "team-a.chat-1"
    log = gw.log()
    events = [e for _, e in log.store.events(scoped_session("t", "team-a.chat-1"))]
    headers = [e.reason for e in events if isinstance(e, HeaderEvent)]
    assert headers == [Reason.INITIAL, Reason.CHANGE]
    assert any(isinstance(e, ReplaceEvent) or e.kind == "truncate" for e in events)
    for row in log.store.requests(scoped_session("t", "team-a.chat-1")):
        _, data = log.rebuild(row.session_id, row.seq)
        assert hashlib.sha256(data).hexdigest() == row.sha256
    assert fold(events).messages[-1].role == "assistant"
    assert sum(isinstance(e, DispatchEvent) for e in events) == 3


def test_the_verifier_refuses_a_request_the_log_cannot_rebuild(
    gw: Gw, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dataclasses

    import gateway.service.provider_chat as pc

    real = pc.ProviderChat.prepare

    async def corrupt(self: Any, name: str, call: Any, quote: Any = None) -> Any:
        """What the log records differs from what the live call renders."""
        p = await real(self, name, call, quote)
        turns = tuple(type(t)(t.role, t.content + "!", t.name) for t in p.turns)
        return dataclasses.replace(p, turns=turns)

    model = f"openai/{MODELS['openai']}"
    before = len(gw.emulator.received())
    monkeypatch.setattr(pc.ProviderChat, "prepare", corrupt)
    r = gw.http.post(
        "/v1/chat/completions",
        headers={"authorization": f"Bearer {KEY}"},
        json={"model": model, "messages": [{"role": "user", "content": "hello"}]},
    )
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["code"] == "reconstruction_mismatch"
    assert "differs from the live request at byte" in err["message"]
    assert len(gw.emulator.received()) == before  # nothing was sent


@pytest.mark.processes
def test_cli_lists_sessions_and_replays_a_request(gw: Gw) -> None:
    import subprocess
    import sys

    model = f"deepseek/{MODELS['deepseek']}"
    replies = converse(gw, model, 2)
    log = gw.log()
    db = str(log.store.path)
    rows = log.store.requests(scoped_session("t", replies[0].headers["x-vcache-session"]))
    cli = [sys.executable, "-m", "gateway.cli"]
    listed = subprocess.run([*cli, "sessions", "--db", db], capture_output=True, text=True)
    assert listed.returncode == 0, listed.stderr
    assert rows[0].session_id in listed.stdout
    done = subprocess.run(
        [*cli, "replay", rows[-1].request_id, "--db", db], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert f"sha256   {rows[-1].sha256}" in done.stdout
    assert "match: the log rebuilds what was sent" in done.stdout
    assert rows[-1].sha256 == gw.emulator.received()[-1]["sha256"]
    body = json.loads(done.stdout.splitlines()[0])
    assert body["model"] == MODELS["deepseek"] and len(body["messages"]) == 4
    missing = subprocess.run([*cli, "replay", "nope", "--db", db], capture_output=True, text=True)
    assert missing.returncode == 2


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup_section",
            "description": "Fetch a manual section by number",
            "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}},
        },
    }
]


@pytest.mark.parametrize("provider", list(MODELS))
def test_tools_added_mid_session_are_a_change_snapshot_and_rebuild(gw: Gw, provider: str) -> None:
    model = f"{provider}/{MODELS[provider]}"
    h = {"authorization": f"Bearer {KEY}", "x-vcache-session": f"tools-{provider}"}
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "first"},
    ]
    r1 = gw.http.post(
        "/v1/chat/completions", headers=h, json={"model": model, "messages": messages}
    )
    assert r1.status_code == 200, r1.text
    messages += [
        {"role": "assistant", "content": r1.json()["choices"][0]["message"]["content"]},
        {"role": "user", "content": "second, with a tool at hand"},
    ]
    r2 = gw.http.post(
        "/v1/chat/completions",
        headers=h,
        json={"model": model, "messages": messages, "tools": TOOLS, "tool_choice": "auto"},
    )
    assert r2.status_code == 200, r2.text
    log = gw.log()
    events = [e for _, e in log.store.events(scoped_session("t", f"tools-{provider}"))]
    snaps = [e for e in events if isinstance(e, HeaderEvent)]
    assert [s.reason for s in snaps] == [Reason.INITIAL, Reason.CHANGE]
    assert snaps[0].header.tools is None and snaps[1].header.tool_list()[0]["function"]["name"]
    rows = log.store.requests(scoped_session("t", f"tools-{provider}"))
    received = [
        r["sha256"] for r in gw.emulator.received() if r["path"] != "/v1beta/cachedContents"
    ]
    assert [row.sha256 for row in rows] == received
    for row in rows:
        _, data = log.rebuild(row.session_id, row.seq)
        assert hashlib.sha256(data).hexdigest() == row.sha256


def test_tools_on_a_local_alias_are_served_by_the_local_model(gw: Gw) -> None:
    r = gw.http.post(
        "/v1/chat/completions",
        headers={"authorization": f"Bearer {KEY}"},
        json={"model": "smart", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS},
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-vcache-target"] == "local"
    assert "x-vcache-fallback-from" not in r.headers
