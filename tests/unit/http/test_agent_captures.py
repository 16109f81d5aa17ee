"""Every request the real agent CLIs sent, recorded from Codex 0.169.0 and 0.171.0,
Claude Code 2.1.328, 2.1.332 and 2.1.337, and on Chat Completions opencode 1.18.33
and Qwen Code 0.24.4 (tests/agents/data, one JSON object a line: method, path, query,
headers, body, and the scenario it came from; the newer ones are the agent tier's own
``captures.jsonl``, Qwen Code's were taken through the tier's tap by hand),
sent again to the gateway over an in-memory engine: each is answered 2xx, whatever the
recording server answered then (the 400s there were the shapes a client sends before
it falls back, which vcache must serve), and no stream carries an error; only what
Anthropic alone runs (Claude Code's ``safeguards``) is refused by name.  The model
names the agents asked for are aliases of the local model; the operator's output
ceiling keeps the fake's answers short.  A new agent version's captures go beside
these."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from engines.fake import FakeEngine
from engines.tokenizer import ChatTokenizer
from gateway.app import create_app
from gateway.core.config import ApiKeyConfig, hash_api_key
from tests.settings import gateway_settings

DATA = Path(__file__).parents[2] / "agents" / "data"
KEY = "sk-captures"
# what is sent again: the generation routes (a WebSocket upgrade is not HTTP/1 traffic)
ROUTES = ("/v1/responses", "/v1/messages", "/v1/chat/completions", "/v1/models")


def _captured() -> list[dict[str, Any]]:
    out = []
    for path in sorted(DATA.glob("*.jsonl")):
        for n, line in enumerate(path.read_text().splitlines()):
            r = json.loads(line)
            upgrade = any(k.lower() == "upgrade" for k in r["headers"])
            if r["path"] in ROUTES and not upgrade:
                out.append({**r, "id": f"{path.stem}:{n}:{r['scenario']}"})
    return out


CAPTURED = _captured()


@pytest.fixture(scope="module")
def http(demo_model: Path) -> Iterator[TestClient]:
    tok = ChatTokenizer.from_pretrained(str(demo_model))
    engine = FakeEngine(tok, block_size=16, max_model_len=131072, reply=" ok")
    names = {r["body"]["model"] for r in CAPTURED if r["method"] == "POST"}
    keys = [ApiKeyConfig(sha256=hash_api_key(KEY), tenant="t", name="agents")]
    cfg = gateway_settings(
        grpc_port=None,
        api_keys=keys,
        aliases={n: ["local"] for n in names},
        engine={"max_output_tokens": 4},
    )
    with TestClient(create_app(cfg, [engine])) as client:
        yield client


def test_the_captures_cover_the_agents_and_their_shapes() -> None:
    scenarios = {r["scenario"] for r in CAPTURED}
    assert any(s.startswith("codex") for s in scenarios)
    assert any(s.startswith("claude") for s in scenarios)
    assert any(s.startswith("opencode") for s in scenarios)
    assert any(s.startswith("qwen-code") for s in scenarios)
    bodies = [r["body"] for r in CAPTURED if r["method"] == "POST"]
    kinds = {t.get("type") for b in bodies for t in b.get("tools", [])}
    assert {"function", "custom", "namespace", "web_search", "tool_search"} <= kinds
    roles = {m["role"] for b in bodies for m in b.get("messages", [])}
    assert "system" in roles  # Claude Code's mid-conversation system messages
    assert "tool" in roles  # opencode's tool results on Chat Completions


@pytest.mark.parametrize("captured", CAPTURED, ids=[r["id"] for r in CAPTURED])
def test_what_the_agent_sent_is_served(http: TestClient, captured: dict[str, Any]) -> None:
    headers = {
        k: v
        for k, v in captured["headers"].items()
        if k.lower()
        not in ("authorization", "x-api-key", "host", "content-length", "accept-encoding")
    }
    headers["authorization"] = f"Bearer {KEY}"
    url = captured["path"] + (f"?{captured['query']}" if captured.get("query") else "")
    if captured["method"] == "GET":
        r = http.get(url, headers=headers)
    else:
        r = http.post(url, json=captured["body"], headers=headers)
    if captured["body"] and captured["body"].get("safeguards"):
        # Anthropic's server-side classifier (Claude Code's auto mode): the local model
        # cannot run it, so it is refused naming the beta (the CLI drops a named beta)
        assert r.status_code == 400, r.text[:2000]
        assert "dangerous-tool-use-2026-09-03" in r.json()["error"]["message"]
        return
    assert r.status_code == 200, r.text[:2000]
    if captured["body"] and captured["body"].get("stream"):
        events = [
            json.loads(line[6:])
            for line in r.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
        assert events
        # an error event: Anthropic's and the Responses API's by type, OpenAI chat's by key
        assert not [e for e in events if e.get("type") == "error" or "error" in e], r.text[:2000]
