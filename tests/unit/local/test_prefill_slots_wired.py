"""The dispatcher hands ``engine.prefill_slots`` to its replicas' gates: with one slot for
the default class, a second default request sent while the first prefills waits (the
prompts are held in prefill until both are placed)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from engines.fake import FakeEngine, Hold
from engines.tokenizer import ChatTokenizer
from gateway.core.metrics import Metrics
from gateway.core.schemas import ChatCompletionRequest, ChatMessage
from gateway.core.types import Principal
from gateway.local.replicas import Replica
from manifest.index import LocationId
from tests.unit.builders import booted, service
from tests.unit.waits import until

WAITS = 'vcache_fair_queue_waits_total{replica="replica-0"}'


def _run(demo_model: Path, prefill_slots: dict[int, int] | None) -> str:
    """The metrics after two default requests sent at once."""

    async def main() -> str:
        hold = Hold(at=0)  # both prompts stay in prefill until the test lets them finish
        engine = FakeEngine(ChatTokenizer.from_pretrained(str(demo_model)), hold=hold)
        await engine.start()
        metrics = Metrics()
        replicas = booted([Replica(LocationId("replica-0"), engine)])
        svc = service(replicas, metrics, prefill_slots=prefill_slots)

        async def ask(text: str) -> str:
            req = ChatCompletionRequest(
                model="vcache-demo",
                messages=[ChatMessage(role="user", content=text)],
                max_tokens=3,
            )
            done = await svc.chat(req, Principal(tenant="t"))
            return done.body.choices[0].message.content or ""

        both = asyncio.gather(ask("one"), ask("two"))
        waits = metrics.registry.get_sample_value
        await until(  # the second in the engine beside the first, or waiting for its slot
            lambda: (
                len(engine.received) == 2
                or waits("vcache_fair_queue_waits_total", {"replica": "replica-0"})
            ),
            "both requests placed",
        )
        hold.release()
        answers = await asyncio.wait_for(both, 10)
        assert all(answers)
        return metrics.render().decode()

    return asyncio.run(main())


def test_one_prefill_slot_makes_the_second_default_request_wait(demo_model: Path) -> None:
    assert f"{WAITS} 1.0" in _run(demo_model, {0: 1})


def test_without_prefill_slots_nothing_waits(demo_model: Path) -> None:
    assert WAITS not in _run(demo_model, None)  # no replica's wait was ever counted
