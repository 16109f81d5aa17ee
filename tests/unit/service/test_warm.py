"""The local cache warm (``/v1/cache/warm``, gRPC ``Warm``) is a request like any other:
admitted (a full queue refuses it before anything is tokenized, journaled or sent),
journaled in the session log and rebuilt from it byte for byte, routed over the
serving replicas only (a dead replica is never chosen, nor warmed when named), and
sent through the replica's fair gate.  Two fake replicas, the exact index over fake
engine cores, the real session log with verification on."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from engines.base import GenerateRequest
from engines.fake import FakeEngine
from engines.providers.specs import adapter_for
from engines.tokenizer import ChatTokenizer
from gateway.core.errors import Unavailable
from gateway.core.metrics import Metrics
from gateway.core.schemas import ChatMessage
from gateway.core.types import Principal
from gateway.local.dispatch import Dispatcher
from gateway.local.replicas import Replica
from gateway.local.spans import KVSpans
from gateway.service.cache import CacheRequest, CacheService, WarmResponse
from gateway.sessions.log import SessionLog
from gateway.sessions.reconstruct import Reconstructor
from gateway.sessions.render import vllm_payload
from gateway.sessions.store import SessionStore
from manifest.index import LocationId
from tests.unit.builders import booted, service
from tests.unit.local.fake_core import FakeCore

MODEL = "vcache-demo"
R0, R1 = LocationId("replica-0"), LocationId("replica-1")
ADMIN = Principal(tenant="t", key_name="admin", admin=True)
PROMPT = "a long system prompt every agent of the tenant starts with " * 8


class BarrierCore(FakeCore):
    """A fake engine core that also answers the KV-events barrier (nothing in transit)."""

    async def call_core(self, method: str, *args: Any) -> Any:
        if method == "vcache_events_barrier":
            self.calls.append(method)
            return -1
        return await super().call_core(method, *args)


@dataclass
class World:
    engines: dict[LocationId, FakeEngine]
    dispatcher: Dispatcher
    log: SessionLog
    cache: CacheService
    metrics: Metrics

    def received(self) -> list[GenerateRequest]:
        return [g for e in self.engines.values() for g in e.received]

    def logged(self) -> list[str]:
        return [r.request_id for r in self.log.store.requests()]


@asynccontextmanager
async def world(demo_model: Path, tmp_path: Path, **dispatch: Any) -> AsyncIterator[World]:
    tok = ChatTokenizer.from_pretrained(str(demo_model))
    engines = {r: FakeEngine(tok, max_model_len=2048) for r in (R0, R1)}
    for e in engines.values():
        await e.start()
    kv = KVSpans(16, "0", pin_max_share=0.5, default_lease_s=60)
    for r in engines:
        kv.attach(r, BarrierCore([], capacity=8, num_blocks=64), f"ipc://{tmp_path}/{r}", None)
    metrics = Metrics()
    replicas = [Replica(r, e) for r, e in engines.items()]
    store = SessionStore(tmp_path / "sessions.db")
    log = SessionLog(store, Reconstructor(adapter_for, lambda: tok), verify=True)
    svc = service(booted(replicas, kv), metrics, log, **dispatch)
    dispatcher = svc.dispatcher
    cache = CacheService(
        svc.local,
        svc.model_name,
        svc.targets,
        svc.providers,
        svc.warm_provider,
        svc.warm_local,
        svc.loop.intake,
    )
    try:
        yield World(engines, dispatcher, log, cache, metrics)
    finally:
        svc.close()
        log.close()
        await kv.close()
        for e in engines.values():
            await e.close()


def _sent(g: GenerateRequest) -> bytes:
    return vllm_payload(g.prompt_token_ids, g.cache_salt, dataclasses.asdict(g.sampling))


WARMS = {
    "prompt": {"prompt": PROMPT},
    "token_ids": {"token_ids": list(range(5, 70))},
    "messages": {"messages": [ChatMessage(role="system", content=PROMPT)]},
}


@pytest.mark.parametrize("named", list(WARMS.values()), ids=list(WARMS))
def test_a_warm_is_journaled_and_rebuilds_byte_for_byte(
    demo_model: Path, tmp_path: Path, named: dict[str, Any]
) -> None:
    async def main() -> None:
        async with world(demo_model, tmp_path) as w:
            body = CacheRequest(model=MODEL, tenant=None, **named)
            first = await w.cache.warm(body, ADMIN)
            [g] = w.received()
            assert g.sampling.max_tokens == 1 and g.cache_salt == "tenant:t"
            assert first.replica == next(r for r, e in w.engines.items() if e.received)
            [rid] = w.logged()
            assert rid == g.request_id and rid.startswith("warm-")
            assert w.log.verified == 1  # rebuilt from the log before it was sent
            row = w.log.store.request(rid)
            assert row is not None
            _, rebuilt = w.log.rebuild(row.session_id, row.seq)
            assert rebuilt == _sent(g)
            again = await w.cache.warm(body, ADMIN)  # where the next request would go
            assert again.replica == first.replica
            assert again.cached_tokens_before == (len(g.prompt_token_ids) - 1) // 16 * 16
            assert len(w.logged()) == 2

    asyncio.run(main())


def test_a_warm_never_goes_to_a_dead_replica(demo_model: Path, tmp_path: Path) -> None:
    async def main() -> None:
        async with world(demo_model, tmp_path) as w:
            body = CacheRequest(model=MODEL, prompt=PROMPT)
            chosen = LocationId((await w.cache.warm(body, ADMIN)).replica)
            other = R1 if chosen == R0 else R0
            dead = w.engines[chosen]
            dead.kill()  # its index entries and its core still answer: only it is gone
            sent = len(dead.received)
            warmed = await w.cache.warm(body, ADMIN)
            assert warmed.replica == other and len(w.engines[other].received) == 1
            named = CacheRequest(model=MODEL, prompt=PROMPT, replica=chosen)
            logged = len(w.logged())
            with pytest.raises(Unavailable) as exc:
                await w.cache.warm(named, ADMIN)
            assert exc.value.code == "engine_unavailable"
            assert len(dead.received) == sent and len(w.logged()) == logged
            assert w.dispatcher.admission.inflight == 0

    asyncio.run(main())


def test_a_full_queue_refuses_a_warm_before_anything_is_done(
    demo_model: Path, tmp_path: Path
) -> None:
    async def main() -> None:
        async with world(demo_model, tmp_path, max_inflight=1) as w:
            body = CacheRequest(model=MODEL, prompt=PROMPT)
            with w.dispatcher.admit("default"):  # a request in flight fills the queue
                with pytest.raises(Unavailable) as exc:
                    await w.cache.warm(body, ADMIN)
                assert exc.value.code == "queue_full"
            assert w.received() == [] and w.logged() == []
            assert (await w.cache.warm(body, ADMIN)).replica in w.engines
            assert w.dispatcher.admission.inflight == 0

    asyncio.run(main())


def test_a_warm_waits_its_turn_in_the_fair_gate(demo_model: Path, tmp_path: Path) -> None:
    async def main() -> None:
        async with world(demo_model, tmp_path, slots=1) as w:
            body = CacheRequest(model=MODEL, prompt=PROMPT, replica=R0)
            gate = w.dispatcher._gates[R0]
            held = await gate.enter("another tenant", 0, 100)  # the engine's one slot

            async def warm() -> WarmResponse:
                return await w.cache.warm(body, ADMIN)

            task = asyncio.create_task(warm())
            for _ in range(500):  # until it is in the gate's queue
                if gate.waited:
                    break
                await asyncio.sleep(0.01)
            assert gate.waited == 1 and len(gate) == 1
            assert not task.done() and w.engines[R0].received == []
            assert w.logged() != []  # journaled before it waits its turn
            gate.leave(held, 0)
            assert (await task).replica == R0 and len(w.engines[R0].received) == 1

    asyncio.run(main())
