"""OpenTelemetry spans of a request: one span per request, a child per step, parented
explicitly (so a streamed answer's spans hold together); none without an endpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
from fastapi.testclient import TestClient
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from engines.fake import FakeEngine
from engines.tokenizer import ChatTokenizer
from gateway.app import create_app
from gateway.core.tracing import Tracing
from tests.settings import gateway_settings

MODEL = "vcache-demo"


def test_a_chat_is_one_span_with_a_child_per_step(demo_model: Path) -> None:
    exporter = InMemorySpanExporter()
    tracing = Tracing(processor=SimpleSpanProcessor(exporter))
    engine = FakeEngine(ChatTokenizer.from_pretrained(str(demo_model)), max_model_len=512)
    app = create_app(gateway_settings(grpc_port=None), [engine], tracing=tracing)
    with TestClient(app) as http:
        sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http)
        sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        stream = sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
        )
        assert len([c for c in stream]) > 3
    spans = exporter.get_finished_spans()
    roots: list[Any] = [s for s in spans if s.name == "vcache.chat"]
    assert len(roots) == 2 and {r.attributes["vcache.stream"] for r in roots} == {True, False}
    for root in roots:
        assert root.attributes["vcache.target"] == "local"
        assert root.attributes["vcache.completion_tokens"] == 3
        children: list[Any] = [
            s for s in spans if s.parent and s.parent.span_id == root.context.span_id
        ]
        assert [c.name for c in children] == [
            "tokenize",  # prepare decides and renders
            "journal",  # what will be sent, recorded
            "route",  # acquire: what waits (the index sync, a prefill to join), then claims
            "dispatch",
            "generate",
        ]
        route = next(c for c in children if c.name == "route")
        assert route.attributes["vcache.replica"] == "replica-0"
        start = {c.name: c.start_time for c in children}
        assert start["dispatch"] <= start["generate"]  # the first token splits them


def test_no_endpoint_no_spans() -> None:
    assert not Tracing().enabled
    trace = Tracing().request("vcache.chat", model="m")
    with trace.step("tokenize"):
        pass
    trace.end(None)  # a no-op tracer: nothing to export, nothing fails
