"""A streamed answer's outputs asked of vLLM every N tokens where the engine makes
several an output interval (gateway/local/coalesce.py): N is decided at prepare from
the replicas' pace, is in what the engine is handed and in what the session log
records (the log rebuilds it byte for byte), and nothing else changes: an answer sent
whole, a slow engine, an interval of 0 or an unknown pace keep what they had."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from engines.base import EngineStats, GenerateRequest
from engines.fake import FakeEngine
from engines.providers.specs import adapter_for
from engines.tokenizer import ChatTokenizer
from gateway.app import create_app
from gateway.sessions.log import SessionLog
from gateway.sessions.reconstruct import Reconstructor
from gateway.sessions.render import vllm_payload
from gateway.sessions.store import SessionStore
from tests.settings import gateway_settings

MODEL = "vcache-demo"


class Paced(FakeEngine):
    """A fake engine that reports the pace a real one measures."""

    def __init__(self, tokenizer: ChatTokenizer, gap_s: float | None) -> None:
        super().__init__(tokenizer, block_size=16, max_model_len=1024)
        self.gap_s = gap_s

    def stats(self) -> EngineStats:
        return dataclasses.replace(super().stats(), token_gap_s=self.gap_s)


@pytest.fixture(scope="module")
def tokenizer(demo_model: Path) -> ChatTokenizer:
    return ChatTokenizer.from_pretrained(str(demo_model))


def _gateway(engine: FakeEngine, interval_ms: float = 20.0) -> TestClient:
    settings = gateway_settings(engine={"output_interval_ms": interval_ms})
    return TestClient(create_app(settings, [engine]))


def _stream(http: TestClient, route: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with http.stream("POST", route, json={"model": MODEL, "stream": True, **body}) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def _chat(http: TestClient, stream: bool = True, **body: Any) -> list[dict[str, Any]]:
    body = {"messages": [{"role": "user", "content": "count to twelve"}], "max_tokens": 12}
    if stream:
        return _stream(http, "/v1/chat/completions", body)
    r = http.post("/v1/chat/completions", json={"model": MODEL, **body})
    assert r.status_code == 200
    return [r.json()]


def _rebuilt(http: TestClient, engine: FakeEngine, g: GenerateRequest) -> bytes:
    """The request ``g`` as the session log rebuilds it offline (``vcache replay``)."""
    live: SessionLog = http.app.state.session_log  # type: ignore[attr-defined]
    store = SessionStore(live.store.path)
    replay = SessionLog(store, Reconstructor(adapter_for, lambda: engine.tokenizer), verify=False)
    try:
        row = store.request(g.request_id)
        assert row is not None
        return replay.rebuild(row.session_id, row.seq)[1]
    finally:
        store.close()


def _content(events: list[dict[str, Any]]) -> list[str]:
    return [e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]]


def test_a_streamed_chat_at_5ms_a_token_asks_for_every_4th(tokenizer: ChatTokenizer) -> None:
    engine = Paced(tokenizer, gap_s=0.005)
    with _gateway(engine) as http:
        live: SessionLog = http.app.state.session_log  # type: ignore[attr-defined]
        verified = live.verified
        events = _chat(http)
        g = engine.received[-1]
        assert g.sampling.stream_interval == 4  # 20 ms at 5 ms a token
        assert live.verified == verified + 1  # rebuilt from the log before it was sent
        rebuilt = _rebuilt(http, engine, g)
        sampling = dataclasses.asdict(g.sampling)
        assert rebuilt == vllm_payload(g.prompt_token_ids, g.cache_salt, sampling)
        assert json.loads(rebuilt)["sampling"]["stream_interval"] == 4
        # the fake engine, as vLLM: the first token, then 4 at a time (12 tokens: 1, 4,
        # 4, 3 in four outputs), one SSE event each
        pieces = [c for c in _content(events) if c]
        assert len(pieces) == 4
        engine.gap_s = None  # a pace not measured: each output as it comes
        whole_text = "".join(_content(_chat(http)))
        assert engine.received[-1].sampling.stream_interval is None
        assert "".join(pieces) == whole_text


def test_a_streamed_text_completion_is_coalesced_too(tokenizer: ChatTokenizer) -> None:
    engine = Paced(tokenizer, gap_s=0.005)
    with _gateway(engine) as http:
        _stream(http, "/v1/completions", {"prompt": "count to twelve", "max_tokens": 12})
        assert engine.received[-1].sampling.stream_interval == 4


@pytest.mark.parametrize(
    ("gap_s", "interval_ms", "stream", "want"),
    [
        (0.030, 20.0, True, None),  # a GPU host's pace: one token an interval at most
        (0.005, 0.0, True, None),  # engine.output_interval_ms 0: no coalescing at all
        (0.005, 20.0, False, 12),  # sent whole: the first token and the last, as before
    ],
    ids=["slow engine", "interval 0", "whole answer"],
)
def test_what_stays_as_it_was(
    tokenizer: ChatTokenizer, gap_s: float, interval_ms: float, stream: bool, want: int | None
) -> None:
    engine = Paced(tokenizer, gap_s=gap_s)
    with _gateway(engine, interval_ms) as http:
        _chat(http, stream=stream)
        assert engine.received[-1].sampling.stream_interval == want


def test_a_coalesced_stream_still_times_its_tokens(tokenizer: ChatTokenizer) -> None:
    """Inter-token latency is observed per output of a coalesced streamed answer (its
    gap over its tokens), as for one read every interval; not for an answer sent whole."""
    engine = Paced(tokenizer, gap_s=0.005)
    itl = 'vcache_inter_token_latency_seconds_count{model="vcache-demo",'
    itl += 'replica="replica-0",target="local"}'
    with _gateway(engine) as http:
        _chat(http, stream=False)
        assert f"{itl} 0.0" in http.get("/metrics").text
        _chat(http)
        assert engine.received[-1].sampling.stream_interval == 4
        # 12 tokens in outputs of 1, 4, 4 and 3: three gaps after the first
        assert f"{itl} 3.0" in http.get("/metrics").text
