"""Replicas that share compute share the first-token guard (``engine.guard_scope``): a
higher class waiting for its first token on one of them holds the lower classes on all,
and stops theirs in prefill; replicas that do not share keep a guard each."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from engines.base import GenerateRequest, SamplingOptions
from engines.fake import FakeEngine, Hold
from engines.tokenizer import ChatTokenizer
from engines.vllm.placement import HostUnits
from gateway.core.config import Settings
from gateway.core.metrics import Metrics
from gateway.local import build
from gateway.local.dispatch import Dispatch, Dispatcher
from gateway.local.fairness import FairGate, Scope
from gateway.local.replicas import Replica
from gateway.local.routing import Router
from manifest.index import LocationId
from tests.unit.builders import booted
from tests.unit.waits import until

INTERACTIVE, DEFAULT, BATCH = -1, 0, 1  # vLLM's priorities: lower first


def test_a_first_token_awaited_on_one_gate_holds_lower_classes_on_its_peers() -> None:
    async def main() -> None:
        scope = Scope()
        a, b = FairGate(None, preempt=True, scope=scope), FairGate(None, preempt=True, scope=scope)
        running = await b.enter("bulk", BATCH, 400)  # in prefill on b
        agent = await a.enter("agent", INTERACTIVE, 500)
        assert running.stop.is_set()  # told to stop, though on the other replica
        b.withdraw(running)
        again = asyncio.create_task(b.enter("bulk", BATCH, 400))
        other = asyncio.create_task(b.enter("other", DEFAULT, 100))
        peer = await asyncio.wait_for(b.enter("agent2", INTERACTIVE, 50), 1)  # its own class
        await asyncio.sleep(0)
        assert not again.done() and not other.done() and b.held == 2
        a.first_token(agent)
        await asyncio.sleep(0)
        assert not again.done() and not other.done()  # the interactive one on b prefills
        b.first_token(peer)
        default = await asyncio.wait_for(other, 1)  # freed by b's own token, the higher first
        await asyncio.sleep(0)
        assert not again.done()  # the default request prefills now
        b.first_token(default)
        await asyncio.wait_for(again, 1)
        assert b.running == 3 and a.running == 1

    asyncio.run(main())


def test_gates_of_their_own_scope_hold_only_their_own_replica() -> None:
    async def main() -> None:
        a, b = FairGate(None, preempt=True), FairGate(None, preempt=True)
        running = await b.enter("bulk", BATCH, 400)
        await a.enter("agent", INTERACTIVE, 500)
        assert not running.stop.is_set()
        await asyncio.wait_for(b.enter("other", DEFAULT, 100), 1)  # starts at once
        assert b.held == 0

    asyncio.run(main())


def test_a_peer_freed_by_a_first_token_is_granted_in_fair_order() -> None:
    """A slot-limited peer: the waiters the guard held go in class order once released."""

    async def main() -> list[str]:
        scope = Scope()
        a, b = FairGate(None, scope=scope), FairGate(1, scope=scope)
        agent = await a.enter("agent", INTERACTIVE, 500)
        order: list[str] = []

        async def one(name: str, prio: int) -> None:
            e = await b.enter(name, prio, 1)
            order.append(name)
            b.leave(e, 1)

        tasks = [asyncio.create_task(one(n, p)) for n, p in (("bulk", BATCH), ("other", DEFAULT))]
        await asyncio.sleep(0)
        assert order == [] and len(b) == 2
        a.leave(agent, 0)  # ended before a token (e.g. failed): it no longer holds b
        await asyncio.wait_for(asyncio.gather(*tasks), 1)
        return order

    assert asyncio.run(main()) == ["other", "bulk"]


def _greq(rid: str, priority: int) -> GenerateRequest:
    prompt = tuple(range(1000 * (priority + 2), 1000 * (priority + 2) + 40))
    return GenerateRequest(
        rid, prompt, SamplingOptions(max_tokens=3), priority=priority, tenant=rid
    )


def _two_replicas(demo_model: Path, shares: str | None) -> tuple[list[str], list[str]]:
    """A batch request in prefill on replica-1, then an interactive one on replica-0
    (every prompt is held in prefill until the test lets it finish, in the order they
    began: a stopped batch prefill is aborted first); the order of first tokens, and
    what replica-1's engine aborted."""

    async def main() -> tuple[list[str], list[str]]:
        tok = ChatTokenizer.from_pretrained(str(demo_model))
        hold = Hold(at=0)
        engines = [FakeEngine(tok, hold=hold) for _ in range(2)]
        for e in engines:
            await e.start()
        replicas = [
            Replica(LocationId(f"replica-{i}"), e, shares=shares) for i, e in enumerate(engines)
        ]
        dispatcher = Dispatcher(
            booted(replicas),
            Router(),
            Metrics(),
            max_inflight=8,
            first_token_guard=True,
            preempt_prefills=True,
        )
        firsts: list[str] = []

        async def send(greq: GenerateRequest, replica: Replica) -> None:
            d = Dispatch(replica, replica.id, None)
            async for _ in dispatcher.run(greq, d, "chat", 0.0):
                if greq.request_id not in firsts:
                    firsts.append(greq.request_id)

        bulk = asyncio.create_task(send(_greq("bulk", BATCH), replicas[1]))
        await until(lambda: hold.waiting("bulk"), "the batch request in prefill")
        agent = asyncio.create_task(send(_greq("agent", INTERACTIVE), replicas[0]))
        await until(lambda: hold.waiting("agent"), "the interactive request in prefill")
        if shares is not None:  # one host: the batch prefill is told to stop, and aborted
            await until(lambda: engines[1].aborted, "the batch prefill stopped")
        else:  # it runs on, and began first: its first token comes first
            hold.release("bulk")
            await until(lambda: "bulk" in firsts, "the batch request's first token")
        hold.release()
        await asyncio.wait_for(agent, 10)
        await asyncio.wait_for(bulk, 10)
        return firsts, list(engines[1].aborted)

    return asyncio.run(main())


def test_replicas_sharing_the_host_stop_each_others_lower_prefills(demo_model: Path) -> None:
    firsts, aborted = _two_replicas(demo_model, "host")
    assert firsts == ["agent", "bulk"] and aborted == ["bulk"]


def test_replicas_of_their_own_leave_each_others_prefills_alone(demo_model: Path) -> None:
    firsts, aborted = _two_replicas(demo_model, None)
    assert firsts == ["bulk", "agent"] and aborted == []


@pytest.mark.parametrize(
    ("scope", "replicas", "cpu", "expected"),
    [
        (None, 2, True, "host"),  # a CPU host: its engines share its cores
        (None, 2, False, None),  # an accelerator host: a device each
        ("host", 2, False, "host"),
        ("replica", 2, True, None),
        ("host", 1, True, None),  # one replica has no peer to share with
    ],
)
def test_the_guard_scope_by_setting_and_host(
    monkeypatch: pytest.MonkeyPatch,
    scope: str | None,
    replicas: int,
    cpu: bool,
    expected: str | None,
) -> None:
    units = HostUnits(cpu=cpu, variable="X", ids=("0", "1"))
    monkeypatch.setattr(build, "host_units", lambda: units)
    settings = Settings(engine={"replicas": replicas, "guard_scope": scope})
    assert build.guard_scope(settings) == expected
