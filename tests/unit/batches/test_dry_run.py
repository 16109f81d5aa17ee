"""The plan before running: a create body with ``"vcache": {"dry_run": true}`` answers
the batch's plan (order, anchors, s, top-7 coverage, predicted cost) and makes
nothing, on both APIs; a bad ``vcache`` field is a 400 naming it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from engines.fake import FakeEngine
from engines.tokenizer import ChatTokenizer
from gateway.app import create_app
from tests.settings import gateway_settings
from tests.unit.batches.conftest import KEY, keys
from tests.unit.batches.test_message_batches import params
from tests.unit.batches.test_openai_batches import ARRIVAL, chat_body, jsonl, line, settings

AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture
def http(tokenizer: ChatTokenizer) -> Iterator[tuple[FakeEngine, TestClient]]:
    engine = FakeEngine(tokenizer, max_model_len=1024)
    with TestClient(create_app(settings(), [engine])) as client:
        yield engine, client


def test_an_openai_dry_run_answers_the_plan_and_makes_nothing(
    http: tuple[FakeEngine, TestClient],
) -> None:
    engine, client = http
    upload = jsonl([line(tag, chat_body(s, tag)) for s, tag in ARRIVAL])
    f = client.post(
        "/v1/files", headers=AUTH, files={"file": ("in.jsonl", upload)}, data={"purpose": "batch"}
    ).json()
    body = {"input_file_id": f["id"], "endpoint": "/v1/chat/completions"}
    r = client.post(
        "/v1/batches",
        headers=AUTH,
        json={**body, "completion_window": "24h", "vcache": {"dry_run": True}},
    )
    assert r.status_code == 200, r.text
    p = r.json()
    assert p["object"] == "batch.plan"
    order = [(x["custom_id"], x["after"]) for x in p["order"]]
    assert order == [
        ("a1", None),
        ("a2", "a1"),
        ("a3", "a1"),
        ("b1", None),
        ("b2", "b1"),
        ("b3", "b1"),
    ]
    assert [a["items"] for a in p["anchors"]] == [3, 3]
    plan = p["plan"]
    assert (plan["units"], plan["prefixes"], plan["top7_coverage"]) == (6, 2, 1.0)
    assert plan["concentration"] is not None
    cost = plan["predicted_cost"]
    assert cost["arrival_order"] == plan["prompt_tokens"]
    assert 0 < cost["billed"] < cost["arrival_order"]
    assert cost["saved"] == pytest.approx(plan["shared_tokens"] * 0.9, abs=0.1)
    # nothing made, nothing sent
    assert client.get("/v1/batches", headers=AUTH).json()["data"] == []
    assert engine.received == []

    bad = client.post(
        "/v1/batches",
        headers=AUTH,
        json={**body, "completion_window": "24h", "vcache": {"dry_run": "yes"}},
    )
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "vcache.dry_run"
    extra = client.post(
        "/v1/batches", headers=AUTH, json={**body, "completion_window": "24h", "vcache": 1}
    )
    assert extra.status_code == 400 and extra.json()["error"]["param"] == "vcache"


def test_an_anthropic_dry_run_answers_the_plan(http: tuple[FakeEngine, TestClient]) -> None:
    engine, client = http
    requests = [{"custom_id": t, "params": params(s, t)} for s, t in ARRIVAL]
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    r = client.post(
        "/v1/messages/batches",
        headers=headers,
        json={"requests": requests, "vcache": {"dry_run": True}},
    )
    assert r.status_code == 200, r.text
    p = r.json()
    assert p["object"] == "batch.plan" and p["endpoint"] == "/v1/messages"
    assert [x["custom_id"] for x in p["order"]] == ["a1", "a2", "a3", "b1", "b2", "b3"]
    assert client.get("/v1/messages/batches", headers=headers).json()["data"] == []
    assert engine.received == []


def test_a_dry_run_on_an_alias_with_hosted_targets_shows_the_provider_plan(
    tokenizer: ChatTokenizer,
) -> None:
    """Each hosted target of the model: online in DAG order against its batch API, and
    the choice; the local target has none; nothing is sent to a provider."""
    cfg = gateway_settings(
        grpc_port=None,
        api_keys=keys(),
        providers={"anthropic": {"base_url": "http://127.0.0.1:9/v1", "api_key": "unused"}},
        aliases={"mix": ["local", "anthropic/claude-sonnet-4-5"]},
    )
    engine = FakeEngine(tokenizer, max_model_len=1024)
    long = "Label the sentiment of each review by the rules. " * 200  # ~2.5k tokens
    requests = [
        {"custom_id": f"r{i}", "params": {**params("A", f"r{i}"), "model": "mix", "system": long}}
        for i in range(6)
    ]
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    with TestClient(create_app(cfg, [engine])) as client:
        r = client.post(
            "/v1/messages/batches",
            headers=headers,
            json={"requests": requests, "vcache": {"dry_run": True}},
        )
    assert r.status_code == 200, r.text
    [p] = r.json()["providers"]
    assert p["target"] == "anthropic/claude-sonnet-4-5"
    assert p["online"]["read_tokens"] > 0 and p["online"]["write_tokens"] > 0
    assert p["online"]["minutes"] is None  # no headroom known before any answer
    assert p["batch_api"]["discount"] == 0.5 and p["batch_api"]["ttl"] == "1h"
    assert p["choice"] in ("online", "batch_api")
    cheaper = min(("online", "batch_api"), key=lambda k: p[k]["cost"])
    assert p["choice"] == cheaper
    assert engine.received == []
