"""A lower class's prompt still in prefill stops for a higher class that arrives on its
replica, and starts again after it (``engine.preempt_prefills``): vLLM would otherwise
compute the two prefills in the same steps."""

from __future__ import annotations

import asyncio
from pathlib import Path

from engines.base import GenerateRequest, SamplingOptions
from engines.fake import FakeEngine, Hold
from engines.tokenizer import ChatTokenizer
from gateway.core.metrics import Metrics
from gateway.local.dispatch import Dispatch, Dispatcher, Totals
from gateway.local.fairness import FairGate
from gateway.local.preempt import MAX_STOPS
from gateway.local.replicas import Replica
from gateway.local.routing import Router
from manifest.index import LocationId
from tests.unit.builders import booted
from tests.unit.waits import until

R = LocationId("replica-0")
STOPS = 'vcache_prefill_stops_total{replica="replica-0"}'
INTERACTIVE, DEFAULT, BATCH = -1, 0, 1  # vLLM's priorities: lower first


def test_a_higher_class_stops_the_lower_prefills_and_only_those() -> None:
    async def main() -> None:
        gate = FairGate(slots=4, preempt=True)
        decoding = await gate.enter("bulk", BATCH, 300)
        gate.first_token(decoding)  # past its prefill: it shares steps a token at a time
        other = await gate.enter("other", DEFAULT, 100)
        await gate.enter("agent", DEFAULT, 50)  # a peer of ``other``: nothing stops
        assert not (other.stop.is_set() or decoding.stop.is_set())
        await gate.enter("agent", INTERACTIVE, 500)
        assert other.stop.is_set() and not decoding.stop.is_set()
        counters = dict(gate.counters)
        gate.withdraw(other)  # its slot and its charge come back
        assert gate.counters["other"] == counters["other"] - 100 and gate.running == 3

    asyncio.run(main())


def test_a_default_request_stops_batch_prefills_too() -> None:
    async def main() -> None:
        gate = FairGate(slots=None, preempt=True)
        bulk = await gate.enter("bulk", BATCH, 400)
        await gate.enter("other", DEFAULT, 100)
        assert bulk.stop.is_set()
        off = FairGate(slots=None, guard=False)  # preempt off: nothing is ever told
        b = await off.enter("bulk", BATCH, 400)
        await off.enter("agent", INTERACTIVE, 100)
        assert not b.stop.is_set()

    asyncio.run(main())


def _dispatcher(engine: FakeEngine, metrics: Metrics, preempt: bool) -> Dispatcher:
    d = Dispatcher(
        booted([Replica(R, engine)]),
        Router(),
        metrics,
        max_inflight=8,
        first_token_guard=True,
        preempt_prefills=preempt,
    )
    return d


def _greq(rid: str, priority: int, tokens: int = 40) -> GenerateRequest:
    prompt = tuple(range(1000 * (priority + 2), 1000 * (priority + 2) + tokens))
    return GenerateRequest(
        rid, prompt, SamplingOptions(max_tokens=3), priority=priority, tenant=rid
    )


def _events(
    demo_model: Path, preempt: bool, arrivals: int = 1
) -> tuple[list[str], FakeEngine, str]:
    """A batch request, then ``arrivals`` interactive ones, each sent once the one before
    it had its first token, while the batch request's latest attempt is in prefill (every
    prompt is held there until the test lets it finish, the engine's prefills in the order
    they began: a stopped batch prefill is aborted first); the order of first tokens and
    ends, as ``rid:first`` / ``rid:end``."""

    async def main() -> tuple[list[str], FakeEngine, str]:
        hold = Hold(at=0)
        engine = FakeEngine(ChatTokenizer.from_pretrained(str(demo_model)), hold=hold)
        await engine.start()
        metrics = Metrics()
        dispatcher = _dispatcher(engine, metrics, preempt)
        replica = dispatcher.replicas[0]
        seen: list[str] = []
        firsts: dict[str, asyncio.Event] = {}

        async def send(greq: GenerateRequest) -> int:
            d = Dispatch(replica, R, None)
            first, completion = True, 0
            async for out in dispatcher.run(greq, d, "chat", 0.0):
                if isinstance(out, Totals):  # the last
                    completion = out.completion
                elif first:
                    seen.append(f"{greq.request_id}:first")
                    firsts.setdefault(greq.request_id, asyncio.Event()).set()
                    first = False
            seen.append(f"{greq.request_id}:end")
            return completion

        bulk = asyncio.create_task(send(_greq("bulk", BATCH)))
        agents = []
        for i in range(arrivals):
            # each comes while the batch request's latest attempt is in prefill
            await until(lambda: hold.waiting("bulk"), "the batch request in prefill")
            agent = f"agent{i}"
            agents.append(asyncio.create_task(send(_greq(agent, INTERACTIVE))))
            await until(lambda: hold.waiting(agent), f"{agent} in prefill")  # noqa: B023
            if preempt and i < MAX_STOPS:  # the batch prefill is told to stop: aborted
                await until(lambda: len(engine.aborted) == i + 1, "the batch prefill stopped")  # noqa: B023
            else:  # it runs on, and began first: its first token comes first
                hold.release("bulk")
                await until(lambda: "bulk:first" in seen, "the batch request's first token")
            hold.release(agent)
            # the batch one starts again after its first token
            await firsts.setdefault(agent, asyncio.Event()).wait()
        hold.release("bulk")
        await asyncio.wait_for(asyncio.gather(*agents), 10)
        assert await asyncio.wait_for(bulk, 10) == 3  # its whole answer, in the end
        return seen, engine, metrics.render().decode()

    return asyncio.run(main())


def test_the_interactive_prompt_goes_first_and_the_batch_one_starts_again(
    demo_model: Path,
) -> None:
    seen, engine, metrics = _events(demo_model, preempt=True)
    assert seen.index("agent0:first") < seen.index("bulk:first")
    assert engine.aborted == ["bulk"]  # its first attempt, aborted in the engine
    assert [r.request_id for r in engine.received] == ["bulk", "agent0", "bulk"]
    assert f"{STOPS} 1.0" in metrics


def test_without_preemption_the_batch_prefill_runs_on(demo_model: Path) -> None:
    seen, engine, metrics = _events(demo_model, preempt=False)
    assert seen.index("bulk:first") < seen.index("agent0:first")
    assert engine.aborted == []
    assert f"{STOPS} 1.0" not in metrics


def test_a_request_is_stopped_at_most_max_stops_times(demo_model: Path) -> None:
    seen, engine, metrics = _events(demo_model, preempt=True, arrivals=MAX_STOPS + 1)
    assert engine.aborted == ["bulk"] * MAX_STOPS
    assert f"{STOPS} {float(MAX_STOPS)}" in metrics
    # the last arrival met a batch prefill that no longer stops
    assert seen.index("bulk:first") < seen.index(f"agent{MAX_STOPS}:first")


def test_a_client_gone_during_a_stoppable_prefill_leaves_nothing_behind(
    demo_model: Path,
) -> None:
    """Cancelled while its first token is awaited (and a stop could come), the request is
    aborted in the engine and its slot is free: the next request does not wait."""

    async def main() -> tuple[FakeEngine, str]:
        hold = Hold(at=0, only={"gone"})  # in prefill until it is cancelled
        engine = FakeEngine(ChatTokenizer.from_pretrained(str(demo_model)), hold=hold)
        await engine.start()
        metrics = Metrics()
        dispatcher = Dispatcher(
            booted([Replica(R, engine)]),
            Router(),
            metrics,
            max_inflight=8,
            slots=1,
            preempt_prefills=True,
            first_token_guard=True,
        )
        replica = dispatcher.replicas[0]

        async def send(greq: GenerateRequest) -> None:
            async for _ in dispatcher.run(greq, Dispatch(replica, R, None), "chat", 0.0):
                pass

        gone = asyncio.create_task(send(_greq("gone", BATCH)))
        await until(lambda: hold.waiting("gone"), "the request in prefill")
        gone.cancel()
        await asyncio.wait({gone})
        assert gone.cancelled(), gone.exception()  # cancelled, and nothing else went wrong
        await asyncio.wait_for(send(_greq("next", BATCH)), 5)
        return engine, metrics.render().decode()

    engine, metrics = asyncio.run(main())
    assert engine.aborted == ["gone"]
    assert 'vcache_fair_queue_waits_total{replica="replica-0"}' not in metrics
