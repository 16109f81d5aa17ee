"""What a request claims before its send (a prefill registration siblings wait on, the
fan-in hold of a cold anchor, the admission and in-flight counts) is given back on
every path, on the real targets: the local replicas (a fake engine, the exact index
over a fake core) and a hosted provider planned by the control loop (nothing is sent
to it here).  Prepare claims nothing; the journal comes next; what waits and claims
is ``acquire``, after it; the loop's ``finally`` releases."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest

from engines.fake import FakeEngine
from engines.tokenizer import ChatTokenizer
from gateway.core.config import ControlSettings
from gateway.core.errors import Unavailable
from gateway.core.metrics import Metrics
from gateway.core.pieces import Piece
from gateway.core.schemas import ChatCompletionRequest, ChatMessage
from gateway.core.target import Call, Target
from gateway.core.types import Principal
from gateway.local.dispatch import Dispatcher
from gateway.local.prefills import Prefill
from gateway.local.replicas import Replica
from gateway.local.spans import KVSpans
from gateway.providers.control import Control
from gateway.providers.path import ProviderPath
from gateway.service.journal import Journal
from gateway.service.local import LocalChat, LocalPrepared
from gateway.service.loop import ServiceLoop
from gateway.service.provider_chat import ProviderChat
from manifest.index import LocationId
from tests.settings import gateway_settings
from tests.unit import builders
from tests.unit.builders import booted
from tests.unit.local.fake_core import FakeCore

R = LocationId("replica-0")
LOCAL, CLAUDE = "local", "anthropic/claude-sonnet-4-5"
WAIT_S = 5.0  # how long a sibling would wait for a prefill, or a fan-in writer, at most
# the siblings' shared prefix: several blocks locally, an anchor past Anthropic's minimum
SYSTEM = "You answer questions about the vcache manual, section by section.\n" * 100
LOCAL_SYSTEM = "You answer questions about the vcache manual, section by section.\n" * 4


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


class SessionLog503(Journal):
    """A journal whose ``sent`` fails as the session log's store boundary fails (503
    ``session_log_unavailable``, Retry-After 2) while ``fail`` is set, and waits for
    ``gate`` (a slow store) while one is set."""

    def __init__(self) -> None:
        super().__init__(None)
        self.fail = False
        self.gate: asyncio.Event | None = None
        self.entered = asyncio.Event()

    async def sent(self, op: Any, request_id: str, *rest: Any) -> None:
        self.entered.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            raise Unavailable(
                "the session log is unavailable (dispatch failed); retry shortly",
                code="session_log_unavailable",
                retry_after_s=2,
            )


@dataclass
class World:
    local: LocalChat
    dispatcher: Dispatcher
    provider: ProviderChat
    control: Control
    journal: SessionLog503
    loop: ServiceLoop
    metrics: Metrics

    def target(self, name: str) -> Target[Any]:
        return self.local if name == LOCAL else self.provider

    def prefill_waits(self) -> float:
        get = self.metrics.registry.get_sample_value
        return sum(
            get("vcache_prefill_waits_total", {"outcome": o}) or 0.0 for o in ("joined", "timeout")
        )

    def assert_released(self) -> None:
        """Every claim a request can make before or at its send is back."""
        d = self.dispatcher
        assert len(d.prefills) == 0  # no prompt a sibling would wait for
        assert d.admission.inflight == 0 and [r.inflight for r in d.replicas] == [0]
        writers = [a.writer for a in self.control.anchors.values()]
        assert all(w is None or w.is_set() for w in writers)  # no sibling held


@asynccontextmanager
async def world(demo_model: Path, tmp_path: Path, wait_s: float = WAIT_S) -> AsyncIterator[World]:
    metrics = Metrics()
    engine = FakeEngine(ChatTokenizer.from_pretrained(str(demo_model)), max_model_len=2048)
    await engine.start()
    kv = KVSpans(16, "0", pin_max_share=0.5, default_lease_s=60)
    kv.attach(R, FakeCore([], capacity=8, num_blocks=64), f"ipc://{tmp_path}/events", None)
    turns = builders.turns(metrics)
    replicas = booted([Replica(R, engine)], kv)
    dispatcher = builders.dispatcher(replicas, metrics, turns, prefill_wait_s=wait_s)
    local = builders.local(dispatcher, turns)
    settings = gateway_settings(
        providers={"anthropic": {"base_url": "http://provider.invalid/v1", "api_key": "k"}},
        control=ControlSettings(mode="govern", fan_wait_s=wait_s),
    )
    clock = Clock()
    control = Control(settings.control, clock)
    path = ProviderPath(settings, metrics, clock, control=control)
    provider = ProviderChat(path, settings.prompt_layout, metrics)
    journal = SessionLog503()
    w = World(
        local,
        dispatcher,
        provider,
        control,
        journal,
        builders.loop(journal, metrics, lambda n: w.target(n)),
        metrics,
    )
    try:
        yield w
    finally:
        local.close()
        await path.close()
        await kv.close()
        await engine.close()


def _call(rid: str, question: str, system: str = SYSTEM) -> Call:
    messages = [
        ChatMessage(role="system", content=system),
        ChatMessage(role="user", content=question),
    ]
    req = ChatCompletionRequest(model="m", messages=messages, max_tokens=2)
    return Call(req, Principal(tenant="t"), rid)


def _local_call(rid: str, question: str) -> Call:
    return _call(rid, question, LOCAL_SYSTEM)


async def _answer(w: World, name: str, call: Call) -> list[Piece]:
    routed = await w.loop.first_answer([name], call)
    return [p async for p in routed.body.pieces]


def test_a_journal_that_fails_leaves_no_claim_and_the_retry_does_not_wait(
    demo_model: Path, tmp_path: Path
) -> None:
    async def main() -> None:
        async with world(demo_model, tmp_path) as w:
            w.journal.fail = True
            for name, call in ((LOCAL, _local_call("a", "one")), (CLAUDE, _call("a", "one"))):
                with pytest.raises(Unavailable) as exc:
                    await _answer(w, name, call)
                assert exc.value.code == "session_log_unavailable"
            w.assert_released()
            w.journal.fail = False  # the client's retry, 2 s later, with the same prefix
            sibling = await w.provider.prepare(CLAUDE, _call("b", "one"))
            start = time.monotonic()
            sibling = await asyncio.wait_for(w.provider.acquire(sibling), 1)
            assert sibling.planned.fan is not None  # the first now: nobody is held for it
            assert w.control.counts["held"] == 0
            w.provider.release(sibling)
            pieces = await asyncio.wait_for(_answer(w, LOCAL, _local_call("b", "one")), 2)
            assert pieces[-1].usage is not None and time.monotonic() - start < WAIT_S
            assert w.prefill_waits() == 0
            w.assert_released()

    asyncio.run(main())


def test_a_client_that_leaves_between_prepare_and_send_leaves_no_claim(
    demo_model: Path, tmp_path: Path
) -> None:
    """It leaves while its request is journaled (a slow session log), and while it waits
    in acquire for a sibling's running prefill."""

    async def main() -> None:
        async with world(demo_model, tmp_path) as w:
            w.journal.gate = asyncio.Event()  # the log's store does not answer
            for name, call in ((LOCAL, _local_call("a", "one")), (CLAUDE, _call("a", "one"))):
                w.journal.entered.clear()
                task = asyncio.create_task(_answer(w, name, call))
                await w.journal.entered.wait()
                task.cancel()  # the client goes away
                with pytest.raises(asyncio.CancelledError):
                    await task
            w.assert_released()
            w.journal.gate = None

            # a sibling's prompt is being prefilled on the replica (acquired, not yet sent)
            first = await w.local.acquire(await w.local.prepare(LOCAL, _local_call("f", "one")))
            running = _watched(first)
            task = asyncio.create_task(_answer(w, LOCAL, _local_call("b", "one")))
            await running.waited.wait()  # the second waits in acquire to join it
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert len(w.dispatcher.prefills) == 1  # the first's only: the second claimed none
            w.local.release(first)
            w.assert_released()

    asyncio.run(main())


def test_a_prefill_whose_send_never_ran_makes_no_sibling_wait(
    demo_model: Path, tmp_path: Path
) -> None:
    """Acquired (its prompt registered as a running prefill) and never sent: given back
    (as the loop's ``finally`` does), a sibling with the same prefix routes at once; held
    (as before, when nothing gave it back), the sibling waits for it until its bound."""

    async def main() -> None:
        async with world(demo_model, tmp_path, wait_s=0.3) as w:
            local = w.local
            gone = await local.acquire(await local.prepare(LOCAL, _local_call("a", "one")))
            assert len(w.dispatcher.prefills) == 1
            local.release(gone)
            sibling = await local.prepare(LOCAL, _local_call("b", "two"))
            sibling = await asyncio.wait_for(local.acquire(sibling), 0.2)
            assert w.prefill_waits() == 0
            local.release(sibling)
            w.assert_released()

            kept = await local.acquire(await local.prepare(LOCAL, _local_call("c", "one")))
            start = time.monotonic()
            late = await local.acquire(await local.prepare(LOCAL, _local_call("d", "two")))
            assert time.monotonic() - start >= 0.3  # it waited for a prefill never sent
            get = w.metrics.registry.get_sample_value
            assert get("vcache_prefill_waits_total", {"outcome": "timeout"}) == 1
            for p in (kept, late):
                local.release(p)
            w.assert_released()

    asyncio.run(main())


class _Watched(asyncio.Event):
    """A prefill's ``done`` that says when someone waits for it."""

    def __init__(self) -> None:
        super().__init__()
        self.waited = asyncio.Event()

    async def wait(self) -> Literal[True]:
        self.waited.set()
        return await super().wait()


def _watched(p: LocalPrepared) -> _Watched:
    prefill: Prefill | None = p.routed.prefill
    assert prefill is not None
    prefill.done = _Watched()
    return prefill.done
