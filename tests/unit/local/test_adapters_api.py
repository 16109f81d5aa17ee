"""LoRA adapters as models over HTTP (fake engines that serve adapters): listed with their
parent and root, served on chat, completions, Responses and Messages under the adapter,
an unknown one a 404 naming it in each API's format, loaded and unloaded at run time by
an admin, a failed load a 400 naming why."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from engines.lora import LoraRef
from engines.tokenizer import ChatTokenizer
from gateway.app import create_app
from gateway.core.config import ApiKeyConfig, Settings, hash_api_key
from gateway.local.adapters import weights_digest
from gateway.session_cli import replay
from gateway.sessions.store import SessionStore
from manifest.sessionlog import Header, fold
from tests.settings import gateway_settings
from tests.unit.local.lora_fake import LoraFakeEngine, adapter_dir

MODEL = "vcache-demo"
ADMIN, USER = "sk-admin", "sk-user"
MESSAGES: Any = [{"role": "user", "content": "hello there"}]


@pytest.fixture
def gw(demo_model: Path, tmp_path: Path) -> Iterator[tuple[LoraFakeEngine, TestClient, Path]]:
    tokenizer = ChatTokenizer.from_pretrained(str(demo_model))
    engine = LoraFakeEngine(tokenizer, block_size=16)
    conf = adapter_dir(tmp_path / "conf", "ad-a")
    adapter_dir(tmp_path / "resolve", "ad-r")
    lora = {
        "enabled": True,
        "max_lora_rank": 8,
        "adapters": {"ad-a": str(conf)},
        "resolver_dir": str(tmp_path / "resolve"),
    }
    keys = [
        ApiKeyConfig(sha256=hash_api_key(ADMIN), tenant="ops", admin=True),
        ApiKeyConfig(sha256=hash_api_key(USER), tenant="u"),
    ]
    settings = gateway_settings(
        grpc_port=None,
        model=str(demo_model),
        served_model_name=MODEL,
        engine={"lora": lora},
        api_keys=keys,
    )
    with TestClient(create_app(settings, [engine])) as http:
        http.headers["Authorization"] = f"Bearer {USER}"
        yield engine, http, tmp_path


def test_models_lists_each_adapter_with_its_parent_and_root(
    gw: tuple[LoraFakeEngine, TestClient, Path],
) -> None:
    _, http, tmp = gw
    cards = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    assert cards["ad-a"]["parent"] == MODEL and cards["ad-a"]["root"] == str(tmp / "conf" / "ad-a")
    assert cards[MODEL]["parent"] is None
    assert "ad-r" not in cards  # in the resolver directory: known once named
    one = http.get("/v1/models/ad-r")
    assert one.status_code == 200 and one.json()["root"] == str(tmp / "resolve" / "ad-r")
    assert http.get("/v1/models/nope").status_code == 404


def test_every_api_runs_the_base_model_under_the_adapter(
    gw: tuple[LoraFakeEngine, TestClient, Path],
) -> None:
    engine, http, tmp = gw
    a = LoraRef("ad-a", str(tmp / "conf" / "ad-a"))
    r = http.post("/v1/chat/completions", json={"model": "ad-a", "messages": MESSAGES})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "ad-a" and engine.received[-1].lora == a
    r = http.post("/v1/completions", json={"model": "ad-a", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "ad-a" and engine.received[-1].lora == a
    r = http.post("/v1/responses", json={"model": "ad-a", "input": "hi", "max_output_tokens": 4})
    assert r.status_code == 200, r.text
    assert engine.received[-1].lora == a
    body = {"model": "ad-r", "messages": MESSAGES, "max_tokens": 4}
    r = http.post("/v1/messages", json=body)  # from the resolver directory, loaded first
    assert r.status_code == 200, r.text
    assert engine.received[-1].lora == LoraRef("ad-r", str(tmp / "resolve" / "ad-r"))
    assert engine.load_calls[-1].name == "ad-r"
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES})
    assert r.status_code == 200 and engine.received[-1].lora is None  # the base model


def test_the_same_prompt_under_two_adapters_is_cold_for_the_second(
    gw: tuple[LoraFakeEngine, TestClient, Path],
) -> None:
    _, http, _ = gw
    long: Any = [{"role": "user", "content": "tell me about the cache " * 20}]

    def cached(model: str) -> int:
        r = http.post("/v1/chat/completions", json={"model": model, "messages": long})
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert cached("ad-a") == 0
    assert cached("ad-a") > 0
    assert cached("ad-r") == 0  # the adapter's blocks are its own
    assert cached(MODEL) == 0


def test_an_unknown_adapter_is_a_404_naming_it_in_each_apis_format(
    gw: tuple[LoraFakeEngine, TestClient, Path],
) -> None:
    _, http, _ = gw
    r = http.post("/v1/chat/completions", json={"model": "ad-x", "messages": MESSAGES})
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and "'ad-x'" in err["message"]
    r = http.post("/v1/messages", json={"model": "ad-x", "messages": MESSAGES, "max_tokens": 4})
    assert r.status_code == 404
    assert r.json()["type"] == "error" and "'ad-x'" in r.json()["error"]["message"]


def test_load_and_unload_at_run_time_by_an_admin(
    gw: tuple[LoraFakeEngine, TestClient, Path],
) -> None:
    engine, http, tmp = gw
    admin = {"Authorization": f"Bearer {ADMIN}"}
    new = adapter_dir(tmp / "new", "ad-n")
    body = {"lora_name": "ad-n", "lora_path": str(new)}
    assert http.post("/v1/load_lora_adapter", json=body).status_code == 403
    r = http.post("/v1/load_lora_adapter", json=body, headers=admin)
    assert r.status_code == 200, r.text
    assert r.json()["replicas"] == ["replica-0"] and engine.held["ad-n"].path == str(new)
    ids = [m["id"] for m in http.get("/v1/models").json()["data"]]
    assert "ad-n" in ids
    listed = {
        e["lora_name"]: e for e in http.get("/v1/lora_adapters", headers=admin).json()["data"]
    }
    n = listed["ad-n"]
    assert (n["lora_path"], n["replicas"], n["leased"]) == (str(new), ["replica-0"], [])
    assert n["sha256"] == weights_digest(new) and n["load_bytes"] > 0
    r = http.post("/v1/chat/completions", json={"model": "ad-n", "messages": MESSAGES})
    assert r.status_code == 200 and engine.received[-1].lora == LoraRef("ad-n", str(new))
    gone = {"lora_name": "ad-n"}
    r = http.post("/v1/unload_lora_adapter", json=gone, headers=admin)
    assert r.status_code == 200 and r.json()["replicas"] == ["replica-0"]
    assert "ad-n" not in engine.held
    r = http.post("/v1/unload_lora_adapter", json=gone, headers=admin)
    assert r.status_code == 404 and "'ad-n'" in r.json()["error"]["message"]
    r = http.post("/v1/chat/completions", json={"model": "ad-n", "messages": MESSAGES})
    assert r.status_code == 404


def test_a_failed_load_is_a_400_naming_why_and_the_replica_serves_on(
    gw: tuple[LoraFakeEngine, TestClient, Path],
) -> None:
    _, http, tmp = gw
    admin = {"Authorization": f"Bearer {ADMIN}"}
    wide = adapter_dir(tmp / "wide", "ad-w", rank=64)
    r = http.post(
        "/v1/load_lora_adapter", json={"lora_name": "ad-w", "lora_path": str(wide)}, headers=admin
    )
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "adapter_load_failed" and "max_lora_rank 8" in err["message"]
    missing = {"lora_name": "ad-m", "lora_path": str(tmp / "nowhere")}
    r = http.post("/v1/load_lora_adapter", json=missing, headers=admin)
    assert r.status_code == 400 and str(tmp / "nowhere") in r.json()["error"]["message"]
    r = http.post(
        "/v1/load_lora_adapter", json={"lora_name": "../x", "lora_path": "/x"}, headers=admin
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
    r = http.post("/v1/chat/completions", json={"model": "ad-a", "messages": MESSAGES})
    assert r.status_code == 200


def test_grpc_runs_the_adapter_and_lists_it(demo_model: Path, tmp_path: Path) -> None:
    import grpc

    from gateway.grpc.api import gateway_pb2 as pb
    from gateway.grpc.api import gateway_pb2_grpc as pb_grpc

    engine = LoraFakeEngine(ChatTokenizer.from_pretrained(str(demo_model)), block_size=16)
    conf = adapter_dir(tmp_path, "ad-a")
    lora = {"enabled": True, "max_lora_rank": 8, "adapters": {"ad-a": str(conf)}}
    settings = gateway_settings(
        grpc_port=0, model=str(demo_model), served_model_name=MODEL, engine={"lora": lora}
    )
    app = create_app(settings, [engine])
    with TestClient(app), grpc.insecure_channel(f"127.0.0.1:{app.state.grpc.port}") as ch:
        stub = pb_grpc.GatewayStub(ch)
        ids = [m.id for m in stub.ListModels(pb.ListModelsRequest()).models]
        assert ids[:2] == [MODEL, "ad-a"]

        def chat(model: str) -> None:
            stub.ChatCompletion(
                pb.ChatCompletionRequest(
                    model=model,
                    messages=[pb.ChatMessage(role="user", content="hello")],
                    sampling=pb.SamplingParams(max_tokens=2),
                )
            )

        chat("ad-a")
        assert engine.received[-1].lora == LoraRef("ad-a", str(conf))
        with pytest.raises(grpc.RpcError) as err:
            chat("ad-x")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and "'ad-x'" in str(
            err.value.details()
        )


def _logged(settings: Settings) -> list[tuple[str, Header]]:
    """Each request in the session log, in order: its id and the header it ran under."""
    store = SessionStore(settings.session_log.db_path(settings.data_dir))
    try:
        out = []
        for row in store.requests():
            header = fold(e for _, e in store.events(row.session_id, row.seq)).header
            assert header is not None
            out.append((row.request_id, header))
        return out
    finally:
        store.close()


def test_the_session_log_records_the_adapter_and_replay_refuses_changed_weights(
    demo_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An adapter request's header snapshot keeps the adapter's name, path and the sha256
    of its weights (read when it became known and at each load, not per request); the
    payload carries it; ``vcache replay`` rebuilds it byte for byte while the weights are
    those, and refuses naming the adapter once they changed or are gone."""
    engine = LoraFakeEngine(ChatTokenizer.from_pretrained(str(demo_model)), block_size=16)
    conf = adapter_dir(tmp_path / "conf", "ad-a")
    weights = conf / "adapter_model.safetensors"
    weights.write_bytes(b"weights one")
    lora = {"enabled": True, "max_lora_rank": 8, "adapters": {"ad-a": str(conf)}}
    keys = [
        ApiKeyConfig(sha256=hash_api_key(ADMIN), tenant="ops", admin=True),
        ApiKeyConfig(sha256=hash_api_key(USER), tenant="u"),
    ]
    settings = gateway_settings(
        grpc_port=None,
        model=str(demo_model),
        served_model_name=MODEL,
        engine={"lora": lora},
        api_keys=keys,
    )
    first = weights_digest(conf)
    assert first is not None
    admin = {"Authorization": f"Bearer {ADMIN}"}
    with TestClient(create_app(settings, [engine])) as http:
        http.headers["Authorization"] = f"Bearer {USER}"
        for model in ("ad-a", MODEL):  # verify on: each rebuilt from the log before it went
            r = http.post("/v1/chat/completions", json={"model": model, "messages": MESSAGES})
            assert r.status_code == 200, r.text
        r = http.post("/v1/completions", json={"model": "ad-a", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert engine.received[-1].lora == LoraRef("ad-a", str(conf))
        assert engine.received[-1].lora.sha256 == first
        # changed on disk, not loaded again: the engine serves what it read, as recorded
        weights.write_bytes(b"weights two")
        r = http.post("/v1/chat/completions", json={"model": "ad-a", "messages": MESSAGES})
        assert r.status_code == 200, r.text
        assert engine.received[-1].lora.sha256 == first
        # unloaded, then named again: read again, loaded again, the new weights recorded
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "ad-a"}, headers=admin)
        assert r.status_code == 200, r.text
        r = http.post("/v1/chat/completions", json={"model": "ad-a", "messages": MESSAGES})
        assert r.status_code == 200, r.text
    second = weights_digest(conf)
    assert second is not None and second != first
    assert engine.received[-1].lora.sha256 == second
    assert [c.name for c in engine.load_calls] == ["ad-a", "ad-a"]  # at start, after unload
    rows = _logged(settings)
    a = {"name": "ad-a", "path": str(conf)}
    recorded = [h.settings().get("adapter") for _, h in rows]
    assert recorded == [{**a, "sha256": first}, None] + [{**a, "sha256": first}] * 2 + [
        {**a, "sha256": second}
    ]
    ids = [rid for rid, _ in rows]
    # the weights on disk now are not those the first request ran with: refused, named
    assert replay(settings, None, ids[0], quiet=True) == 1
    err = capsys.readouterr().err
    assert "'ad-a'" in err and f"recorded sha256 {first}, now sha256 {second}" in err
    assert replay(settings, None, ids[4], quiet=True) == 0  # recorded with these
    assert replay(settings, None, ids[1], quiet=True) == 0  # the base model's
    capsys.readouterr()
    weights.write_bytes(b"weights one")  # as they were: the first four replay
    for rid in ids[:4]:
        assert replay(settings, None, rid, quiet=False) == 0
    out = capsys.readouterr().out
    assert out.count('"adapter":{"name":"ad-a"') == 3  # in the payload (not the base's)
    shutil.rmtree(conf)
    assert replay(settings, None, ids[0], quiet=True) == 1
    err = capsys.readouterr().err
    assert "'ad-a'" in err and "are gone" in err


def test_the_cache_api_takes_an_adapter_as_its_model(
    gw: tuple[LoraFakeEngine, TestClient, Path],
) -> None:
    """warm and evict name an adapter's spans on the local replicas (no provider's): with
    the fake engine's no KV events, each is the local path's 503, not a 404."""
    _, http, _ = gw
    admin = {"Authorization": f"Bearer {ADMIN}"}
    for op in ("warm", "evict", "lookup", "pin"):
        r = http.post(
            f"/v1/cache/{op}", json={"model": "ad-a", "messages": MESSAGES}, headers=admin
        )
        assert r.status_code == 503, (op, r.text)
        assert r.json()["error"]["code"] == "kv_tracking_unavailable"
    r = http.post("/v1/cache/warm", json={"model": "ad-x", "messages": MESSAGES}, headers=admin)
    assert r.status_code == 404 and "'ad-x'" in r.json()["error"]["message"]
