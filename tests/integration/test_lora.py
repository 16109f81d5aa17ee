"""LoRA adapters on real vLLM CPU replicas: the demo model and its two demo adapters
(built locally), served as models through the official ``openai`` client.

One gateway of this module's own (two embedded replicas with LoRA on; the shared
session gateway runs without it): predictions equal vLLM's cached tokens on a mixed
stream of base and adapter requests; the same prompt under two adapters shares no
block; an adapter loaded on one replica at run time is routed there, unloaded and
loaded again; requests running under an adapter finish when it is unloaded; a failed
load names why; an unknown adapter is a 404 naming it.
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest

from engines.vllm.demo_lora import DEMO_ADAPTERS, DemoLoraSpec, ensure_demo_lora
from gateway.core.config import Settings
from gateway.session_cli import replay
from tests.integration.conftest import ADMIN, ADMIN_KEY, ADMIN_KEYS, own_gateway, wait_for

pytestmark = pytest.mark.integration

MODEL = "vcache-demo"
A, B = DEMO_ADAPTERS
BLOCK = 128
WORDS = "cache block token model request answer system prompt value server client".split()


@dataclass(frozen=True)
class LoraGateway:
    url: str
    resolve_dir: Path  # holds "demo-lora-c" (seed 3)
    wide: Path  # a rank-16 adapter (the engines' maximum is 8)
    other: Path  # an adapter outside the resolver directory
    spare: Path  # another (seed 6), outside it too
    tmp: Path  # the gateway's own: its session log is tmp/sessions.db
    settings: Settings  # what ``vcache replay`` reads the log with
    closing: contextlib.ExitStack  # the clients handed out, closed with the gateway

    def client(self) -> openai.OpenAI:
        client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=ADMIN_KEY, max_retries=0)
        return self.closing.enter_context(client)

    def admin(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=ADMIN, timeout=120)


@pytest.fixture(scope="module")
def lora_gw(
    data_dir: Path, demo_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LoraGateway]:
    tmp = tmp_path_factory.mktemp("lora")
    built = tmp / "built"
    resolve = tmp / "resolve"
    resolve.mkdir()
    shutil.copytree(
        ensure_demo_lora(built, demo_model, "c", DemoLoraSpec(seed=3)), resolve / "demo-lora-c"
    )
    wide = ensure_demo_lora(built, demo_model, "wide", DemoLoraSpec(seed=4, rank=16))
    other = ensure_demo_lora(built, demo_model, "other", DemoLoraSpec(seed=5))
    spare = ensure_demo_lora(built, demo_model, "spare", DemoLoraSpec(seed=6))
    settings = {
        **ADMIN_KEYS,
        "VCACHE_ENGINE__LORA__ENABLED": "true",
        "VCACHE_ENGINE__LORA__MAX_LORAS": "2",
        "VCACHE_ENGINE__LORA__MAX_CPU_LORAS": "4",
        "VCACHE_ENGINE__LORA__MAX_LORA_RANK": "8",
        "VCACHE_ENGINE__LORA__DEMO_ADAPTERS": "true",
        "VCACHE_ENGINE__LORA__RESOLVER_DIR": str(resolve),
    }
    args = ["--replicas", "2", "--kv-cache-bytes", str(32 << 20), "--max-model-len", "2048"]
    offline = Settings(data_dir=data_dir, model=str(demo_model))
    with own_gateway(tmp, data_dir, args, settings) as url, contextlib.ExitStack() as closing:
        yield LoraGateway(url, resolve, wide, other, spare, tmp, offline, closing)


def _text(seed: int, n: int) -> str:
    return " ".join(random.Random(seed).choices(WORDS, k=n))


@dataclass(frozen=True)
class Served:
    cached: int  # vLLM's count
    predicted: int  # the gateway's
    replica: str
    prompt_tokens: int


def _chat(client: openai.OpenAI, model: str, messages: list[dict[str, str]]) -> Served:
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=1,
        temperature=0,
    )
    body = raw.parse()
    assert body.model == model and body.usage is not None
    details = body.usage.prompt_tokens_details
    predicted = raw.headers.get("x-vcache-predicted-cached-tokens")
    assert predicted is not None, "the gateway makes no exact prediction"
    return Served(
        details.cached_tokens if details and details.cached_tokens else 0,
        int(predicted),
        raw.headers["x-vcache-replica"],
        body.usage.prompt_tokens,
    )


def test_the_adapters_are_listed_as_models_of_the_base_model(lora_gw: LoraGateway) -> None:
    models = {m.id: m for m in lora_gw.client().models.list().data}
    for name in (A, B):
        card: Any = models[name]
        assert card.parent == MODEL and Path(card.root, "adapter_config.json").is_file()
    one: Any = lora_gw.client().models.retrieve("demo-lora-c")  # in the resolver directory
    assert one.root == str(lora_gw.resolve_dir / "demo-lora-c")


def test_predictions_equal_vllms_cached_tokens_for_base_and_adapters(
    lora_gw: LoraGateway,
) -> None:
    client = lora_gw.client()
    system = _text(1, 400)  # shared by every request: ~3 blocks
    stream = [MODEL, A, B, A, MODEL, B, A, B, MODEL, A]
    seen: list[tuple[str, Served]] = []
    for i, model in enumerate(stream):
        user = _text(100 + i % 3, 200)  # three users: repeats under another model too
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        got = _chat(client, model, messages)
        seen.append((model, got))
        assert got.predicted == got.cached, (i, model, got)
    assert sum(s.cached for _, s in seen) > 0  # the stream hit the cache


def test_the_same_prompt_under_two_adapters_shares_no_block(lora_gw: LoraGateway) -> None:
    client = lora_gw.client()
    messages = [{"role": "user", "content": _text(7, 500)}]
    first = _chat(client, A, messages)
    again = _chat(client, A, messages)
    assert again.cached == again.predicted >= (again.prompt_tokens - 1) // BLOCK * BLOCK > 0
    under_b = _chat(client, B, messages)
    assert (under_b.predicted, under_b.cached) == (0, 0)  # cold for B, as predicted
    base = _chat(client, MODEL, messages)
    assert (base.predicted, base.cached) == (0, 0)
    assert first.predicted == first.cached == 0
    answers = {
        model: client.chat.completions.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=8,
            temperature=0,
        )
        .choices[0]
        .message.content
        for model in (MODEL, A, B)
    }
    # the adapters reach the model (random weights: one may keep the base's greedy answer
    # to a prompt, as demo-lora-a did to this one once)
    assert len(set(answers.values())) >= 2, answers


def test_an_adapter_loaded_on_one_replica_is_routed_there_and_unloaded(
    lora_gw: LoraGateway,
) -> None:
    client, c = lora_gw.client(), "demo-lora-c"
    with lora_gw.admin() as admin:
        r = admin.post(
            "/v1/load_lora_adapter",
            json={
                "lora_name": c,
                "lora_path": str(lora_gw.resolve_dir / c),
                "replica": "replica-1",
            },
        )
        assert r.status_code == 200, r.text
        assert r.json()["replicas"] == ["replica-1"]
        for seed in range(4):  # whatever the prompt
            got = _chat(client, c, [{"role": "user", "content": _text(200 + seed, 300)}])
            assert got.replica == "replica-1" and got.predicted == got.cached
        held = {
            e["lora_name"]: e["replicas"] for e in admin.get("/v1/lora_adapters").json()["data"]
        }
        assert held[c] == ["replica-1"] and sorted(held[A]) == ["replica-0", "replica-1"]
        r = admin.post("/v1/unload_lora_adapter", json={"lora_name": c})
        assert r.status_code == 200 and r.json()["replicas"] == ["replica-1"]
        # still in the resolver directory: the next request loads it again where it goes
        got = _chat(client, c, [{"role": "user", "content": _text(300, 100)}])
        assert got.predicted == got.cached
        # one loaded from elsewhere at run time, then unloaded everywhere: gone
        other = {"lora_name": "ad-other", "lora_path": str(lora_gw.other)}
        r = admin.post("/v1/load_lora_adapter", json=other)
        assert r.status_code == 200 and sorted(r.json()["replicas"]) == ["replica-0", "replica-1"]
        _chat(client, "ad-other", [{"role": "user", "content": "hello"}])
        r = admin.post("/v1/unload_lora_adapter", json={"lora_name": "ad-other"})
        assert r.status_code == 200
    with pytest.raises(openai.NotFoundError) as err:
        _chat(client, "ad-other", [{"role": "user", "content": "hello"}])
    assert "'ad-other'" in str(err.value)


def test_requests_running_under_an_adapter_finish_when_it_is_unloaded(
    lora_gw: LoraGateway,
) -> None:
    """Unloaded while four streamed answers under it run: each runs to its end (every
    token asked for), and the next request loads it again (it is in the resolver
    directory) and is predicted exactly."""
    client, c, n, tokens = lora_gw.client(), "demo-lora-c", 4, 160
    _chat(client, c, [{"role": "user", "content": _text(500, 40)}])  # loaded somewhere
    begun = [threading.Event() for _ in range(n)]
    ended = [threading.Event() for _ in range(n)]
    got: list[tuple[int, str | None]] = [(0, None)] * n
    failed: list[BaseException] = []

    def stream(i: int) -> None:
        try:
            count, finish = 0, None
            with client.chat.completions.create(
                model=c,
                messages=[{"role": "user", "content": _text(510 + i, 60)}],
                max_tokens=tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            ) as chunks:
                for ch in chunks:
                    if ch.choices and ch.choices[0].delta.content:
                        begun[i].set()
                    if ch.choices and ch.choices[0].finish_reason:
                        finish = ch.choices[0].finish_reason
                    if ch.usage is not None:
                        count = ch.usage.completion_tokens
            got[i] = (count, finish)
        except BaseException as exc:  # reported below, in the test's thread
            failed.append(exc)
        finally:
            begun[i].set()
            ended[i].set()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    try:
        assert all(b.wait(120) for b in begun), "the answers did not begin"
        running = [i for i in range(n) if not ended[i].is_set()]
        with lora_gw.admin() as admin:
            r = admin.post("/v1/unload_lora_adapter", json={"lora_name": c})
        assert r.status_code == 200, r.text
    finally:
        for t in threads:
            t.join(300)
    assert not failed, failed
    assert running, "every answer ended before the unload: nothing was tested"
    assert all(got[i] == (tokens, "length") for i in running), got
    again = _chat(client, c, [{"role": "user", "content": _text(500, 40)}])
    assert again.predicted == again.cached
    with lora_gw.admin() as admin:
        held = {
            e["lora_name"]: e["replicas"] for e in admin.get("/v1/lora_adapters").json()["data"]
        }
    assert held.get(c), "served again, so loaded again"


def test_a_failed_load_names_why_and_the_replicas_serve_on(lora_gw: LoraGateway) -> None:
    with lora_gw.admin() as admin:
        r = admin.post(
            "/v1/load_lora_adapter", json={"lora_name": "ad-wide", "lora_path": str(lora_gw.wide)}
        )
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "adapter_load_failed" and "rank" in err["message"].lower()
        missing = {"lora_name": "ad-gone", "lora_path": str(lora_gw.resolve_dir / "nowhere")}
        r = admin.post("/v1/load_lora_adapter", json=missing)
        assert r.status_code == 400 and "ad-gone" in r.json()["error"]["message"]
    got = _chat(lora_gw.client(), A, [{"role": "user", "content": "still serving"}])
    assert got.predicted == got.cached


def test_an_unknown_adapter_is_a_404_naming_it(lora_gw: LoraGateway) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        _chat(lora_gw.client(), "no-such-adapter", [{"role": "user", "content": "hi"}])
    assert "'no-such-adapter'" in str(err.value)
    body = {
        "model": "no-such-adapter",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}],
    }
    r = httpx.post(f"{lora_gw.url}/v1/messages", json=body, headers=ADMIN, timeout=60)
    assert r.status_code == 404 and json.loads(r.text)["type"] == "error"


def test_a_session_under_an_adapter_replays_and_refuses_changed_weights(
    lora_gw: LoraGateway, capsys: pytest.CaptureFixture[str]
) -> None:
    """The log records the adapter (name, path, sha256 of its weights): ``vcache replay``
    rebuilds each turn byte for byte, and refuses naming the adapter once its weights
    changed."""
    where = lora_gw.tmp / "replayed" / "ad-replay"
    shutil.copytree(lora_gw.other, where)
    client = lora_gw.client()
    with lora_gw.admin() as admin:
        r = admin.post(
            "/v1/load_lora_adapter", json={"lora_name": "ad-replay", "lora_path": str(where)}
        )
        assert r.status_code == 200, r.text
        messages: list[dict[str, str]] = [{"role": "user", "content": _text(400, 150)}]
        ids = []
        for turn in range(2):
            body = client.chat.completions.create(
                model="ad-replay",
                messages=messages,  # type: ignore[arg-type]
                max_tokens=4,
                temperature=0,
                extra_headers={"x-vcache-session": "lora-replay"},
            )
            ids.append(body.id)
            messages += [
                {"role": "assistant", "content": body.choices[0].message.content or ""},
                {"role": "user", "content": _text(401 + turn, 40)},
            ]
        db = lora_gw.tmp / "sessions.db"
        for rid in ids:
            assert replay(lora_gw.settings, db, rid, quiet=False) == 0
        out = capsys.readouterr().out
        assert out.count('"adapter":{"name":"ad-replay"') == 2
        assert out.count("match: the log rebuilds what was sent") == 2
        # other weights at the same path: replay refuses, naming the adapter
        shutil.copy(lora_gw.spare / "adapter_model.safetensors", where)
        assert replay(lora_gw.settings, db, ids[1], quiet=True) == 1
        err = capsys.readouterr().err
        assert "'ad-replay'" in err and "changed since" in err
        shutil.copy(lora_gw.other / "adapter_model.safetensors", where)
        assert replay(lora_gw.settings, db, ids[1], quiet=True) == 0
        r = admin.post("/v1/unload_lora_adapter", json={"lora_name": "ad-replay"})
        assert r.status_code == 200, r.text


def test_cache_lookup_and_pins_under_an_adapter_are_its_own(lora_gw: LoraGateway) -> None:
    client = lora_gw.client()
    messages = [{"role": "user", "content": _text(500, 400)}]
    ran = _chat(client, A, messages)
    with lora_gw.admin() as admin:

        def lookup(model: str) -> dict[str, int]:
            r = admin.post("/v1/cache/lookup", json={"model": model, "messages": messages})
            assert r.status_code == 200, r.text
            return {x["replica"]: x["predicted_cached_tokens"] for x in r.json()["replicas"]}

        under_a = lookup(A)
        assert under_a[ran.replica] >= (ran.prompt_tokens - 1) // BLOCK * BLOCK > 0
        assert set(lookup(B).values()) == {0} and set(lookup(MODEL).values()) == {0}
        pin = {"model": A, "messages": messages, "replica": ran.replica, "lease_s": 60}
        r = admin.post("/v1/cache/pin", json=pin)
        assert r.status_code == 200, r.text
        assert r.json()["replicas"][0]["pinned"]

        def leased() -> list[str]:
            listed = admin.get("/v1/lora_adapters").json()["data"]
            return next(e["leased"] for e in listed if e["lora_name"] == A)

        assert leased() == [ran.replica]  # the adapter stays loaded there while pinned
        r = admin.post("/v1/cache/unpin", json=pin)
        assert r.status_code == 200, r.text
        assert leased() == []
        # a warm under an adapter fills that adapter's blocks, as its next request finds
        warmed = [{"role": "user", "content": _text(510, 400)}]
        r = admin.post("/v1/cache/warm", json={"model": B, "messages": warmed})
        assert r.status_code == 200, r.text
        w = r.json()
        assert w["cached_tokens_before"] == 0 and w["cached_tokens_after"] > 0
        r = admin.post("/v1/cache/lookup", json={"model": A, "messages": warmed})
        assert {x["predicted_cached_tokens"] for x in r.json()["replicas"]} == {0}
    got = _chat(client, B, warmed)
    assert got.replica == w["replica"]
    assert got.cached == got.predicted >= w["cached_tokens_after"]


def test_ten_concurrent_first_requests_load_a_resolved_adapter_once(
    lora_gw: LoraGateway,
) -> None:
    """An adapter in the resolver directory that no replica holds: ten requests at once
    are all served, on one replica, after one load; the first's added time is printed
    (the closing note's figure)."""
    shutil.copytree(lora_gw.spare, lora_gw.resolve_dir / "demo-lora-d")
    client = lora_gw.client()
    with lora_gw.admin() as admin:
        before = admin.get("/v1/lora_adapters").json()["loads"]
        got: list[tuple[Served, float]] = []
        lock = threading.Lock()

        def first(i: int) -> None:
            t0 = time.perf_counter()
            s = _chat(client, "demo-lora-d", [{"role": "user", "content": _text(600 + i, 60)}])
            with lock:
                got.append((s, time.perf_counter() - t0))

        threads = [threading.Thread(target=first, args=(i,)) for i in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(got) == 10 and all(s.predicted == s.cached for s, _ in got)
        listed = admin.get("/v1/lora_adapters").json()
        assert listed["loads"] == before + 1  # one load for the ten
        (entry,) = [e for e in listed["data"] if e["lora_name"] == "demo-lora-d"]
        assert len(entry["replicas"]) == 1 and {s.replica for s, _ in got} == set(entry["replicas"])
        t0 = time.perf_counter()
        _chat(client, "demo-lora-d", [{"role": "user", "content": _text(700, 60)}])
        warm = time.perf_counter() - t0
        slowest = max(t for _, t in got)
        print(
            f"\nfirst requests for an unloaded adapter: slowest of ten {slowest:.3f} s, "
            f"a later one {warm:.3f} s; load measured {entry['load_seconds']} s, "
            f"{entry['load_bytes']} bytes"
        )


def _engine_cores(url: str) -> list[psutil.Process]:
    """The engine cores under the gateway that listens at ``url``."""
    port = int(url.rsplit(":", 1)[1])
    (pid,) = {
        c.pid
        for c in psutil.net_connections("tcp")
        if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN
    }
    gw = psutil.Process(pid)
    return [p for p in gw.children(recursive=True) if p.name() == "VLLM::EngineCore"]


def test_killed_engine_cores_come_back_with_their_adapters_and_no_stale_blocks(
    lora_gw: LoraGateway,
) -> None:
    """kill -9 of every engine core (this module's last test): the supervisor restarts
    them, the adapters configured at start are held again, an adapter loaded at run time
    is loaded again by the next request that names it, and no block under an adapter is
    predicted from the dead engines."""
    client = lora_gw.client()
    messages = [{"role": "user", "content": _text(800, 300)}]
    with lora_gw.admin() as admin:
        rt = {"lora_name": "ad-rt", "lora_path": str(lora_gw.other), "replica": "replica-0"}
        assert admin.post("/v1/load_lora_adapter", json=rt).status_code == 200
        _chat(client, A, messages)
        again = _chat(client, A, messages)
        assert again.cached == again.predicted > 0
        cores = _engine_cores(lora_gw.url)
        assert len(cores) == 2
        for core in cores:
            core.kill()
        wait_for(lambda: httpx.get(f"{lora_gw.url}/readyz").status_code == 503, timeout_s=30)
        wait_for(lambda: httpx.get(f"{lora_gw.url}/readyz").status_code == 200, timeout_s=300)
        held = {
            e["lora_name"]: e["replicas"] for e in admin.get("/v1/lora_adapters").json()["data"]
        }
        assert sorted(held[A]) == sorted(held[B]) == ["replica-0", "replica-1"]  # configured
        assert held["ad-rt"] == []  # loaded at run time: not held by the new engines
        r = admin.post("/v1/cache/lookup", json={"model": A, "messages": messages})
        assert r.status_code == 200, r.text
        assert {x["predicted_cached_tokens"] for x in r.json()["replicas"]} == {0}
    cold = _chat(client, A, messages)
    assert cold.predicted == cold.cached == 0  # nothing stale under the adapter
    warm = _chat(client, A, messages)
    assert warm.predicted == warm.cached > 0
    rt_served = _chat(client, "ad-rt", [{"role": "user", "content": "back again"}])
    assert rt_served.predicted == rt_served.cached
