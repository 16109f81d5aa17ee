"""The generation routes served past FastAPI's router (gateway/http/direct.py) answer
exactly as the FastAPI routes they stand in for: the same errors in the same order (in
each API's format), the same answers, the same request metrics."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from engines.fake import FakeEngine
from engines.tokenizer import ChatTokenizer
from gateway.app import create_app
from gateway.http.direct import DirectRoutes
from gateway.http.middleware import Receive, Scope, Send
from tests.settings import gateway_settings

URL = "/v1/chat/completions"
JSON = {"content-type": "application/json"}
MESSAGES = [{"role": "user", "content": "Say something."}]


def _app(demo_model: Path, direct: bool) -> FastAPI:
    engine = FakeEngine(ChatTokenizer.from_pretrained(str(demo_model)), max_model_len=512)
    app = create_app(gateway_settings(), [engine])
    if not direct:  # the FastAPI route alone, as before the direct routes
        kept = [m for m in app.user_middleware if cast(object, m.cls) is not DirectRoutes]
        app.user_middleware = kept
    return app


def _direct_layer(app: FastAPI) -> DirectRoutes:
    layer: Any = app.middleware_stack
    while not isinstance(layer, DirectRoutes):
        layer = layer.app
    return layer


@pytest.fixture
def pair(demo_model: Path) -> Iterator[tuple[TestClient, TestClient]]:
    """(the direct route, FastAPI's route); the direct one's router fails any chat call."""
    direct, routed = _app(demo_model, True), _app(demo_model, False)
    with TestClient(direct) as d, TestClient(routed) as r:
        layer = _direct_layer(direct)
        router = layer.app

        async def no_chat(scope: Scope, receive: Receive, send: Send) -> None:
            direct = {("POST", p) for p in ROUTES}
            assert (scope.get("method"), scope.get("path")) not in direct, "router reached"
            await router(scope, receive, send)

        layer.app = no_chat
        yield d, r


def _both(pair: tuple[TestClient, TestClient], url: str = URL, **kw: Any) -> tuple[Any, Any]:
    d, r = (c.post(url, **kw) for c in pair)
    assert d.status_code == r.status_code, (d.text, r.text)
    assert d.headers["content-type"] == r.headers["content-type"]
    return d, r


CASES: list[tuple[str, dict[str, Any], int]] = [
    ("invalid JSON", {"content": b'{"model": ', "headers": JSON}, 400),
    ("empty body", {"content": b"", "headers": JSON}, 400),
    (
        "not a JSON content type",
        {"content": b'{"messages": []}', "headers": {"content-type": "text/plain"}},
        400,
    ),
    ("no content type", {"content": b'{"messages": []}'}, 400),
    ("a JSON array", {"json": [1, 2]}, 400),
    ("messages missing", {"json": {"model": "vcache-demo"}}, 400),
    ("messages not a list", {"json": {"messages": "hi"}}, 400),
    ("a message not an object", {"json": {"messages": ["hi"]}}, 400),
    ("temperature not a number", {"json": {"messages": MESSAGES, "temperature": "hot"}}, 400),
    ("n out of range", {"json": {"messages": MESSAGES, "n": 0}}, 400),
    ("an unknown model", {"json": {"model": "nope", "messages": MESSAGES}}, 404),
    (
        "a bad session header, bad JSON: the JSON first",
        {"content": b"{", "headers": {**JSON, "x-vcache-session": "no spaces"}},
        400,
    ),
    (
        "a bad session header, no messages: the header first",
        {"json": {"model": "x"}, "headers": {"x-vcache-session": "no spaces"}},
        400,
    ),
    (
        "a routing header without an admin key",
        {"json": {"messages": MESSAGES}, "headers": {"x-vcache-routing": "kv_aware"}},
        403,
    ),
]


def _same(error: dict[str, Any]) -> dict[str, Any]:
    """An error body without its request id (the Messages API's: one a request)."""
    assert isinstance(error.pop("request_id", ""), str)
    return error


# each direct route: a body it answers, and one missing a required field
ROUTES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    URL: ({"messages": MESSAGES, "max_tokens": 4}, {"max_tokens": 4}),
    "/v1/completions": ({"prompt": "Say", "max_tokens": 4}, {"max_tokens": 4}),
    "/v1/responses": (
        {"model": "vcache-demo", "input": "Say something.", "max_output_tokens": 16},
        {"input": "Say something."},
    ),
    "/v1/messages": (
        {"model": "vcache-demo", "messages": MESSAGES, "max_tokens": 4},
        {"messages": MESSAGES},
    ),
}
COMMON: list[tuple[str, dict[str, Any]]] = [
    ("invalid JSON", {"content": b'{"model": ', "headers": JSON}),
    ("empty body", {"content": b"", "headers": JSON}),
    ("text/plain", {"content": b'{"prompt": "x"}', "headers": {"content-type": "text/plain"}}),
    ("a JSON array", {"json": [1, 2]}),
    ("not UTF-8", {"content": b'{"model": "\xff"}', "headers": JSON}),
    ("nested too deep", {"content": b"[" * 100_000, "headers": JSON}),
]


@pytest.mark.parametrize("url", list(ROUTES))
def test_each_routes_errors_and_answers_are_fastapis(
    pair: tuple[TestClient, TestClient], url: str
) -> None:
    good, incomplete = ROUTES[url]
    for case, kw in [
        *COMMON,
        ("a required field missing", {"json": incomplete}),
        ("an unknown model", {"json": {**good, "model": "nope"}}),
    ]:
        d, r = _both(pair, url, **kw)
        assert d.status_code >= 400, (url, case, d.text)
        assert _same(d.json()) == _same(r.json()), (url, case)
    d, r = _both(pair, url, json=good)
    assert d.status_code == 200, d.text
    assert d.json().keys() == r.json().keys()


@pytest.mark.parametrize(("case", "kw", "status"), CASES, ids=[c[0] for c in CASES])
def test_an_error_is_the_routes_error(
    pair: tuple[TestClient, TestClient], case: str, kw: dict[str, Any], status: int
) -> None:
    d, r = _both(pair, **kw)
    assert d.status_code == status, d.text
    assert d.json() == r.json()


def test_a_whole_answer_is_the_routes_answer(pair: tuple[TestClient, TestClient]) -> None:
    body = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    d, r = _both(pair, json=body)
    assert d.status_code == 200, d.text
    a, b = d.json(), r.json()
    assert a["choices"] == b["choices"]
    assert a["usage"] == b["usage"]
    assert d.headers.get("x-vcache-replica") == r.headers.get("x-vcache-replica")


def test_a_stream_is_the_routes_stream(pair: tuple[TestClient, TestClient]) -> None:
    body = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0, "stream": True}
    d, r = _both(pair, json=body)
    assert d.status_code == 200, d.text

    def events(text: str) -> list[str]:
        lines = [ln for ln in text.splitlines() if ln.startswith("data: ")]
        return [ln.split('"content":', 1)[-1] if "content" in ln else ln[-8:] for ln in lines]

    assert events(d.text) == events(r.text)
    assert d.text.rstrip().endswith("data: [DONE]")


def test_requests_are_counted_under_the_routes_path(pair: tuple[TestClient, TestClient]) -> None:
    d, _ = pair
    d.post(URL, json={"messages": MESSAGES, "max_tokens": 2})
    d.post(URL, content=b"{", headers=JSON)
    metrics = d.get("/metrics").text
    assert 'vcache_requests_total{route="/v1/chat/completions",status="200"} 1.0' in metrics
    assert 'vcache_requests_total{route="/v1/chat/completions",status="400"} 1.0' in metrics


def test_a_bug_is_raised_to_the_server_as_on_fastapis_route(
    pair: tuple[TestClient, TestClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception no handler but the catch-all takes goes on to the server-error
    middleware (its 500, then raised to the server: here, to the test client) on both."""

    async def broken(*args: Any, **kw: Any) -> Any:
        raise RuntimeError("a bug")

    for client in pair:
        monkeypatch.setattr(cast(FastAPI, client.app).state.service, "chat", broken)
        with pytest.raises(RuntimeError, match="a bug"):
            client.post(URL, json={"messages": MESSAGES, "max_tokens": 2})
