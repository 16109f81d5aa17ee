"""Two gateways, active-active, in front of one vLLM replica: the session log in a real
PostgreSQL database, the shared state in a real Redis, each gateway on its own KV-event
subscription.  A conversation moves between them, pins of both live side by side, and
one killed with SIGKILL under load loses nothing it acknowledged."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import psycopg
import pytest

from tests.integration.conftest import (
    ADMIN,
    ADMIN_KEY,
    ADMIN_KEYS,
    RemoteVllm,
    _free_port,
    rebuild_all,
    running,
    wait_for,
)
from tests.stores.servers import postgres_database, redis_keys

pytestmark = pytest.mark.integration

BLOCK = 128
LEASE = 20.0  # the victim's pin lease: longer than it lives under the load
SYSTEM = "Active-active gateways share one log and one replica. " * 30


@dataclass(frozen=True)
class Shared:
    remote: RemoteVllm
    pg: str
    redis: str
    prefix: str
    data_dir: Path
    tmp: Path

    @contextlib.contextmanager
    def gateway(self, name: str) -> Iterator[tuple[str, Any]]:
        port = _free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("VCACHE_")}
        env |= {
            "VCACHE_REMOTE_REPLICAS": json.dumps([self.remote.replica()]),
            "VCACHE_SESSION_LOG__URL": self.pg,
            "VCACHE_SESSION_LOG__VERIFY_RECONSTRUCTION": "true",
            "VCACHE_STATE__URL": self.redis,
            "VCACHE_STATE__PREFIX": self.prefix,
            "VCACHE_INSTANCE_ID": name,
            **ADMIN_KEYS,
        }
        cmd = [
            sys.executable,
            "-m",
            "gateway.cli",
            "serve",
            "--replicas",
            "0",
            "--port",
            str(port),
            "--grpc-port",
            str(_free_port()),
            "--data-dir",
            str(self.data_dir),
        ]
        url = f"http://127.0.0.1:{port}"
        with running(cmd, env, f"{url}/readyz", self.tmp / f"{name}.log", name) as proc:
            yield url, proc


@pytest.fixture(scope="module")
def shared(
    remote_vllm: RemoteVllm, data_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Shared]:
    with postgres_database() as pg, redis_keys() as (redis, prefix):
        yield Shared(remote_vllm, pg, redis, prefix, data_dir, tmp_path_factory.mktemp("aa"))


@pytest.fixture(scope="module")
def pair(shared: Shared) -> Iterator[tuple[str, str]]:
    with shared.gateway("gw-a") as (a, _), shared.gateway("gw-b") as (b, _):
        yield a, b


def _openai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=ADMIN_KEY, max_retries=0)


def _exact(headers: Any, cached: int) -> bool:
    return int(headers["x-vcache-predicted-cached-tokens"]) == cached


def test_a_conversation_moves_between_gateways_and_rebuilds_from_the_shared_log(
    pair: tuple[str, str], shared: Shared, demo_model: Path, closing: contextlib.ExitStack
) -> None:
    a, b = pair
    chat = {u: closing.enter_context(_openai(u)) for u in (a, b)}
    head = {"x-vcache-session": "moving-chat"}
    messages: list[Any] = [{"role": "system", "content": SYSTEM}]
    cached = []
    for i, url in enumerate((a, b, a, b)):
        messages.append({"role": "user", "content": f"turn {i}: go on"})
        raw = chat[url].chat.completions.with_raw_response.create(
            model="vcache-demo", messages=messages, max_tokens=3, extra_headers=head
        )
        r = raw.parse()
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        got = r.usage.prompt_tokens_details.cached_tokens or 0
        assert _exact(raw.headers, got), f"turn {i}: predicted != {got}"  # exact on both
        assert raw.headers["x-vcache-session"] == "moving-chat"
        cached.append(got)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
    print(f"\nchat turns across gateways A,B,A,B: cached tokens {cached}")
    assert all(c >= (len(SYSTEM) // 8 // BLOCK) * BLOCK for c in cached[1:])

    first = chat[a].responses.create(
        model="vcache-demo", input="a response on A", max_output_tokens=3, store=True
    )
    second = chat[b].responses.with_raw_response.create(
        model="vcache-demo",
        input="continued on B",
        max_output_tokens=3,
        previous_response_id=first.id,
    )
    assert second.parse().previous_response_id == first.id
    assert chat[a].responses.retrieve(second.parse().id).id == second.parse().id

    msgs: list[Any] = [{"role": "user", "content": "a message on A"}]
    sdk = {
        u: closing.enter_context(anthropic.Anthropic(base_url=u, api_key=ADMIN_KEY, max_retries=0))
        for u in (a, b)
    }
    one = sdk[a].messages.with_raw_response.create(
        model="vcache-demo",
        max_tokens=3,
        system=SYSTEM,
        messages=msgs,
        extra_headers={"x-vcache-session": "moving-messages"},
    )
    msgs += [
        {"role": "assistant", "content": one.parse().content[0].text},  # type: ignore[union-attr]
        {"role": "user", "content": "and on B"},
    ]
    two = sdk[b].messages.with_raw_response.create(
        model="vcache-demo",
        max_tokens=3,
        system=SYSTEM,
        messages=msgs,
        extra_headers={"x-vcache-session": "moving-messages"},
    )
    assert two.headers["x-vcache-session"] == "moving-messages"
    assert _exact(two.headers, two.parse().usage.cache_read_input_tokens or 0)

    with psycopg.connect(shared.pg) as db:
        rows = db.execute(
            "SELECT s.id, COUNT(r.request_id) FROM sessions s JOIN requests r "
            "ON r.session_id = s.id GROUP BY s.id"
        ).fetchall()
    counts = {sid.rsplit("/", 1)[-1]: n for sid, n in rows}
    assert counts["moving-chat"] == 4 and counts["moving-messages"] == 2
    rebuilt, failed = rebuild_all(Path("/nonexistent"), demo_model, url=shared.pg)
    print(f"shared log: {rebuilt} requests rebuilt byte for byte")
    assert failed == [] and rebuilt >= 8


def _engine_pins(url: str) -> int:
    stats = httpx.get(f"{url}/v1/cache/stats", headers=ADMIN, timeout=30).json()
    return int(stats["replicas"]["remote-0"]["engine"]["pinned_blocks"])


def test_pins_of_two_gateways_live_side_by_side(pair: tuple[str, str]) -> None:
    a, b = pair
    body = {"model": "vcache-demo", "prompt": "pinned by both gateways " * 60, "lease_s": 600}
    warmed = httpx.post(f"{a}/v1/cache/warm", json=body, headers=ADMIN, timeout=60).json()
    blocks = warmed["cached_tokens_after"] // BLOCK
    assert blocks >= 2
    base = _engine_pins(a)
    for url in (a, b):
        pinned = httpx.post(f"{url}/v1/cache/pin", json=body, headers=ADMIN, timeout=60).json()
        assert len(pinned["replicas"][0]["pinned"]) == blocks
    assert _engine_pins(a) == base + blocks  # one engine pin per block, two holders
    httpx.post(f"{a}/v1/cache/unpin", json=body, headers=ADMIN, timeout=60).raise_for_status()
    assert _engine_pins(b) == base + blocks  # A let go; B's hold keeps them
    httpx.post(f"{b}/v1/cache/unpin", json=body, headers=ADMIN, timeout=60).raise_for_status()
    assert _engine_pins(a) == base


@dataclass
class Load:
    """Users sending short chats to two gateways, a new connection per request, as a
    load balancer opens them.  A request that fails without an answer after its gateway
    was killed never reached a live process: the user, as a load balancer would, drops
    that gateway and sends it to the other.  Any other failure is an error."""

    urls: dict[str, str]
    stop: threading.Event = field(default_factory=threading.Event)
    acked: list[tuple[str, str]] = field(default_factory=list)  # (gateway, response id)
    errors: list[tuple[str, str]] = field(default_factory=list)
    retried: int = 0  # sent after the kill to the dead gateway, then to the other
    inflight: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    killed: str | None = None  # the gateway killed, once it is

    def user(self, n: int) -> None:
        i = 0
        fresh = httpx.Limits(max_keepalive_connections=0)
        with httpx.Client(headers=ADMIN, timeout=60, limits=fresh) as c:
            while not self.stop.is_set():
                i += 1
                ask = [{"role": "user", "content": f"user {n} asks {i}"}]
                body = {"model": "vcache-demo", "max_tokens": 2, "messages": ask}
                with self.lock:  # one choice, one count, one URL: all before or after a kill
                    names = sorted(self.urls)
                    name = names[(n + i) % len(names)]
                    url = self.urls[name]
                    self.inflight[name] = self.inflight.get(name, 0) + 1
                    after_kill = self.killed == name
                try:
                    r = c.post(f"{url}/v1/chat/completions", json=body)
                    with self.lock:
                        if r.status_code == 200:
                            self.acked.append((name, r.json()["id"]))
                        else:
                            self.errors.append((name, f"{r.status_code} {r.text[:200]}"))
                except Exception as exc:
                    with self.lock:
                        if after_kill and isinstance(exc, httpx.TransportError):
                            self.retried += 1  # to the other gateway from now on
                            self.urls = {k: v for k, v in self.urls.items() if k != name}
                        else:  # cut off in flight, or an answer that is not one
                            self.errors.append((name, repr(exc)))
                finally:
                    with self.lock:
                        self.inflight[name] -= 1


def test_a_gateway_killed_under_load_loses_nothing_it_acknowledged(
    pair: tuple[str, str], shared: Shared
) -> None:
    a, _ = pair
    base = _engine_pins(a)
    with shared.gateway("gw-victim") as (victim, proc):
        # a lease that outlives the victim: it dies holding it (held LEASE + 10 s)
        body = {"model": "vcache-demo", "prompt": "held by the victim " * 60, "lease_s": LEASE}
        httpx.post(
            f"{victim}/v1/cache/warm", json=body, headers=ADMIN, timeout=60
        ).raise_for_status()
        pin = httpx.post(f"{victim}/v1/cache/pin", json=body, headers=ADMIN, timeout=60)
        held = len(pin.json()["replicas"][0]["pinned"])
        pinned_at = time.monotonic()
        assert held >= 2 and _engine_pins(a) == base + held
        load = Load({"a": a, "victim": victim})
        users = [threading.Thread(target=load.user, args=(n,)) for n in range(16)]
        for u in users:
            u.start()
        wait_for(lambda: sum(1 for g, _ in load.acked if g == "victim") >= 20, timeout_s=60)
        with load.lock:  # no user starts a request until the victim is gone
            in_flight = load.inflight.get("victim", 0)
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            load.killed = "victim"
        died_after = time.monotonic() - pinned_at
        killed = len(load.acked)
        wait_for(lambda: len(load.acked) >= killed + 40, timeout_s=60)  # the survivor serves
        load.stop.set()
        for u in users:
            u.join(60)
    on_victim = [rid for g, rid in load.acked if g == "victim"]
    print(
        f"\nkill -9 under load: {len(load.acked)} acknowledged ({len(on_victim)} by the "
        f"victim), {len(load.errors)} errors, {in_flight} in flight on the victim, "
        f"{load.retried} sent to it after its death and then to the survivor"
    )
    assert all(g == "victim" for g, _ in load.errors), load.errors  # the survivor: none
    assert len(load.errors) <= in_flight
    with psycopg.connect(shared.pg) as db:
        logged = {r[0] for r in db.execute("SELECT request_id FROM requests").fetchall()}
    missing = [rid for _, rid in load.acked if rid not in logged]
    assert missing == []  # every acknowledged request is in the shared log
    # its hold (the lease + 10 s) runs out in the engine; the survivor's sweep frees it
    assert died_after < LEASE, "the victim outlived its lease: nothing was left to leak"
    wait_for(lambda: _engine_pins(a) == base, timeout_s=LEASE + 40, interval_s=0.5)
    released_after = time.monotonic() - pinned_at
    print(
        f"the victim died {died_after:.1f} s after pinning; its pins were released "
        f"{released_after:.1f} s after they were taken"
    )
    assert released_after >= LEASE + 10 - 1  # not before the hold ran out
