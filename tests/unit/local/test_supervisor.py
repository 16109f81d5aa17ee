"""Replica supervision, narrated on fake engines with a fake clock: death, backoff, restart."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from engines.fake import FakeEngine
from engines.tokenizer import ChatTokenizer
from gateway.app import create_app
from gateway.core.errors import Unavailable
from gateway.core.metrics import Metrics
from gateway.local.dispatch import Dispatcher
from gateway.local.replica_set import ReplicaSet
from gateway.local.replicas import Replica
from gateway.local.routing import Router
from gateway.local.supervisor import Supervisor, backoff_s
from manifest.index import LocationId
from tests.settings import gateway_settings


@pytest.fixture(scope="module")
def tokenizer(demo_model: Path) -> ChatTokenizer:
    return ChatTokenizer.from_pretrained(str(demo_model))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Factory:
    """Builds fresh fake engines; ``fail`` makes the next starts raise."""

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self.tokenizer = tokenizer
        self.built: list[FakeEngine] = []
        self.fail = 0

    def __call__(self) -> FakeEngine:
        factory = self

        class Engine(FakeEngine):
            async def start(self) -> None:
                if factory.fail:
                    factory.fail -= 1
                    raise RuntimeError("CUDA out of memory")
                await super().start()

        e = Engine(self.tokenizer)
        self.built.append(e)
        return e


def _setup(
    tokenizer: ChatTokenizer, n: int, changes: list[bool] | None = None
) -> tuple[Supervisor, Dispatcher, Factory, Clock]:
    """``changes``: whether a replica was ready, at each change the supervisor told."""
    told = changes if changes is not None else []
    factory, clock = Factory(tokenizer), Clock()
    built = [Replica(LocationId(f"replica-{i}"), factory(), factory=factory) for i in range(n)]
    replicas = ReplicaSet(built, clock)
    dispatcher = Dispatcher(replicas, Router(), Metrics(), max_inflight=8)

    async def changed() -> None:
        told.append(any(h.state == "ready" for h in replicas.health.values()))

    sup = Supervisor(
        replicas,
        dispatcher,
        pin_max_share=0.5,
        default_lease_s=60,
        on_change=changed,
        backoff_base_s=2.0,
        backoff_cap_s=8.0,
    )
    return sup, dispatcher, factory, clock


def test_backoff_doubles_to_the_cap() -> None:
    assert [backoff_s(i, 1.0, 10.0) for i in range(6)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert backoff_s(500, 1.0, 10.0) == 10.0  # no overflow


def test_a_dead_replica_is_unrouted_then_restarted_after_backoff(
    tokenizer: ChatTokenizer,
) -> None:
    async def scenario() -> None:
        changes: list[bool] = []
        sup, dispatcher, factory, clock = _setup(tokenizer, 2, changes)
        await sup.boot()
        assert sup.report()["replica-0"]["state"] == "ready" and changes == [True]

        factory.built[0].kill()  # the engine core process exited
        await sup.check()
        assert sup.health[LocationId("replica-0")].state == "dead"
        assert [r.id for r in dispatcher.serving()] == ["replica-1"]
        assert not sup.engine_dead and any(h.state == "ready" for h in sup.health.values())
        assert sup.retry_after_s() == 2.0  # first backoff

        clock.now += 1.9
        await sup.check()
        assert len(factory.built) == 2  # not yet
        clock.now += 0.1
        await sup.check()
        assert len(factory.built) == 3
        assert dispatcher.replicas[0].engine is factory.built[2]
        last = "the engine process died"  # kept after the restart: what happened last
        assert sup.report()["replica-0"] == {"state": "ready", "restarts": 1, "last_error": last}
        assert len(dispatcher.serving()) == 2
        assert changes == [True, True, True]
        await sup.close()

    asyncio.run(scenario())


def test_failed_restarts_back_off_and_every_dead_replica_is_503(
    tokenizer: ChatTokenizer,
) -> None:
    async def scenario() -> None:
        sup, dispatcher, factory, clock = _setup(tokenizer, 1)
        await sup.boot()
        factory.built[0].kill()
        factory.fail = 2
        await sup.check()
        assert sup.engine_dead
        with pytest.raises(Unavailable) as exc:
            await dispatcher.route(_request(tokenizer), None)
        assert exc.value.code == "engine_unavailable"
        assert exc.value.headers() == {"Retry-After": "2"}

        clock.now += 2.0
        await sup.check()  # attempt 1 fails: next in 4 s
        h = sup.health[LocationId("replica-0")]
        assert (h.state, h.failures) == ("dead", 1)
        assert h.last_error == "restart failed: RuntimeError: CUDA out of memory"
        assert sup.retry_after_s() == 4.0
        clock.now += 4.0
        await sup.check()  # attempt 2 fails: next in 8 s
        assert sup.retry_after_s() == 8.0
        clock.now += 8.0
        await sup.check()  # attempt 3 succeeds
        assert (h.state, h.failures, h.restarts) == ("ready", 0, 1)
        assert not sup.engine_dead
        d = await dispatcher.route(_request(tokenizer), None)
        assert d.replica.engine is factory.built[-1]
        await sup.close()

    asyncio.run(scenario())


def _request(tokenizer: ChatTokenizer):  # type: ignore[no-untyped-def]
    from engines.base import GenerateRequest, SamplingOptions

    return GenerateRequest("r1", tuple(tokenizer.encode("hi")), SamplingOptions(max_tokens=1))


def test_http_reports_engine_dead_then_recovers(tokenizer: ChatTokenizer) -> None:
    """Over HTTP: healthz/readyz say engine_dead, chat is 503 with Retry-After, then back."""
    factory = Factory(tokenizer)
    built = [Replica(LocationId("replica-0"), factory(), factory=factory)]
    settings = gateway_settings(
        grpc_port=None,
        engine={"watch_interval_s": 0.01, "restart_backoff_s": 3600, "restart_backoff_cap_s": 3600},
    )
    app = create_app(settings, built)
    body = {"model": "vcache-demo", "messages": [{"role": "user", "content": "hi"}]}
    with TestClient(app) as c:
        assert c.get("/readyz").json()["status"] == "ready"
        factory.built[0].kill()
        sup: Supervisor = app.state.supervisor
        _wait(lambda: sup.engine_dead)
        for path in ("/healthz", "/health", "/readyz"):
            r = c.get(path)
            assert r.status_code == 503
            assert r.json()["status"] == "engine_dead"
            assert r.json()["replicas"]["replica-0"]["state"] == "dead"
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "engine_unavailable"
        assert 3500 <= int(r.headers["retry-after"]) <= 3600
        sup.health[LocationId("replica-0")].next_attempt_at = 0.0  # due now
        _wait(lambda: any(h.state == "ready" for h in sup.health.values()))
        assert c.get("/healthz").status_code == 200
        assert c.get("/readyz").json()["replicas"]["replica-0"]["restarts"] == 1
        assert c.post("/v1/chat/completions", json=body).status_code == 200


def _wait(cond, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    import time

    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met"
        time.sleep(0.01)


def test_the_hash_probe_fits_a_short_context(tokenizer: ChatTokenizer) -> None:
    sup, *_ = _setup(tokenizer, 1)
    assert len(sup.probe_tokens(FakeEngine(tokenizer, block_size=16, max_model_len=2048))) == 33
    assert len(sup.probe_tokens(FakeEngine(tokenizer, block_size=128, max_model_len=256))) == 255
