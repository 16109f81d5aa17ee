"""A warm request's hold sent ahead of it, on the one ordered channel to its engine core.

The core below applies what reaches its input between two engine steps, in the order
it was sent (as vLLM's engine core does with one client's ZMQ socket): a core call
sent ahead of a request is applied at the same step boundary as the request, before
the request is queued.  A hold awaited while routing is applied one boundary earlier,
and the request waits for the next one.  Either way the hold is taken before the
request is queued, so what the engine serves equals the prediction.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Coroutine, Sequence
from pathlib import Path
from typing import Any

import pytest

from engines.base import GenerateChunk, GenerateRequest
from engines.errors import EngineUnavailable
from engines.vllm.span_control import SpanControl
from gateway.core.errors import Unavailable
from gateway.local.dispatch import Dispatch, Dispatcher, Totals, prediction_result
from gateway.local.kv_holds import HoldResult
from manifest.hashing import block_hashes
from tests.unit.local.test_prediction_races import (
    A_PROMPT,
    B_PROMPT,
    BS,
    SHARED,
    R,
    SimEngine,
    _dispatcher,
    _greq,
)
from tests.unit.waits import until


def _at_once(coro: Coroutine[Any, Any, Any]) -> Any:
    """A coroutine that finishes without waiting, run to its value."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    raise AssertionError("it waited")


class Core(SimEngine):
    """An engine and its core: core calls and requests reach the core's input in the
    order they are sent; :meth:`step` applies them (a step boundary).  ``ordered``: the
    engine can send a core call ahead of its requests (``send_core``), as the embedded
    engine does; else (a remote replica's control endpoint) it only awaits calls."""

    def __init__(
        self,
        resident: Sequence[bytes],
        ordered: bool = True,
        pressure: bool = False,
        **options: Any,
    ) -> None:
        super().__init__(resident, **options)
        self.core_ordered = ordered
        self.pressed = pressure  # requests that ran before it was scheduled took every free block
        self.inputs: list[tuple[str, Any, asyncio.Future[Any]]] = []
        self.applied: list[tuple[int, str]] = []  # (step boundary, what it applied)
        self.steps = 0
        self.send_fails = False  # the send itself fails (a dead core)
        self.request_fails = False  # the request fails in the engine after it is queued

    def send_core(self, method: str, *args: Any) -> Awaitable[Any]:
        if self.send_fails:
            raise EngineUnavailable("the engine process died")
        reply = asyncio.get_running_loop().create_future()
        self.inputs.append((method, args, reply))
        return reply

    async def call_core(self, method: str, *args: Any) -> Any:
        if method == "vcache_events_barrier":
            return -1
        reply = asyncio.get_running_loop().create_future()
        self.inputs.append((method, args, reply))
        return await reply

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[GenerateChunk, None]:
        queued = asyncio.get_running_loop().create_future()
        self.inputs.append((f"add:{request.request_id}", request, queued))
        cached = await queued
        if self.request_fails:
            raise EngineUnavailable("the engine process died")
        prompt = len(request.prompt_token_ids)
        yield GenerateChunk("x", (1,), prompt, cached, finish_reason="stop")

    def step(self) -> None:
        inputs, self.inputs = self.inputs, []
        for what, args, reply in inputs:
            self.applied.append((self.steps, what))
            if reply.cancelled():
                continue
            if what.startswith("add:"):
                if self.pressed:
                    self.pressure()
                reply.set_result(self.schedule(args.prompt_token_ids))
                continue
            try:
                reply.set_result(_at_once(SimEngine.call_core(self, what, *args)))
            except RuntimeError as exc:  # the plugin's own failure
                reply.set_exception(exc)
        self.steps += 1

    def when(self, what: str) -> int:
        return next(s for s, w in self.applied if w == what)


async def _stepping(core: Core) -> None:
    while True:
        core.step()
        await asyncio.sleep(0)


async def _answer(d: Dispatcher, x: Dispatch, rid: str, prompt: tuple[int, ...]) -> int:
    """Run the request to its end: the cached tokens the engine reported."""
    cached = None
    async for out in d.run(_greq(rid, prompt), x, "chat", 0.0):
        if isinstance(out, Totals):
            cached = out.cached
        else:
            assert x.approximate != "hold_pending"  # the answer is read before any chunk
    assert cached is not None
    return cached


def test_the_hold_goes_with_its_request_one_step_sooner_and_is_its_prediction(
    tmp_path: Path,
) -> None:
    """Routed warm (three blocks), its hold is not awaited: it is sent right before the
    request and applied at the same step boundary, before the request is queued.  Every
    free block is taken before vLLM schedules it; held, the three stay: predicted 48,
    served 48, exact.  Awaited (an engine that cannot send ahead), the request reaches
    the core one boundary later, with the same prediction."""

    async def main(ordered: bool) -> tuple[int, int, Dispatch, int]:
        engine = Core(SHARED, ordered=ordered, pressure=True)
        d, kv = _dispatcher(engine, tmp_path / str(ordered))
        stepping = asyncio.create_task(_stepping(engine))
        x = await d.route(_greq("b", B_PROMPT), None)
        routed = list(engine.applied)
        served = await _answer(d, x, "b", B_PROMPT)
        await kv.holds.flush()  # the release, sent after the hold
        await until(lambda: engine.holds == {}, "released in the engine")
        stepping.cancel()
        await kv.close()
        assert kv.holds.held == {R: 0} and kv.holds.pending() == 0
        results = d._metrics.registry.get_sample_value
        assert results("vcache_prediction_results_total", {"result": "exact", "cause": ""}) == 1
        gap = engine.when("add:b") - engine.when("vcache_hold")
        assert engine.when("vcache_release") > engine.when("add:b")
        return gap, len(routed), x, served

    (tmp_path / "True").mkdir()
    (tmp_path / "False").mkdir()
    gap, routed, x, served = asyncio.run(main(ordered=True))
    assert routed == 0  # routing sent nothing and waited for no step
    assert gap == 0  # the hold and the request applied at one step boundary, in order
    assert (x.predicted_cached_tokens, served) == (3 * BS, 3 * BS)
    assert x.headers()["x-vcache-prediction"] == "exact" and x.approximate == ""
    assert prediction_result(x, served) == ("exact", "")

    gap, routed, x, served = asyncio.run(main(ordered=False))
    assert routed == 1 and gap >= 1  # held while routing: the request a step later
    assert (x.predicted_cached_tokens, served) == (3 * BS, 3 * BS) and x.approximate == ""


def test_until_its_answer_the_prediction_is_the_indexs_and_says_so(tmp_path: Path) -> None:
    """Between routing and the hold's answer, the prediction is the index's, marked
    approximate (``hold_pending``); the hold answered holds fewer blocks than the index
    listed (one was evicted): the prediction is the engine's, 32, and what it serves."""

    async def main() -> None:
        engine = Core(SHARED)
        d, kv = _dispatcher(engine, tmp_path)
        # no step boundary until the request is sent: routing waits for none
        x = await asyncio.wait_for(d.route(_greq("b", B_PROMPT), None), 5)
        assert (x.predicted_cached_tokens, x.approximate) == (3 * BS, "hold_pending")
        assert x.headers()["x-vcache-prediction"] == "approximate"
        assert x.ahead is not None and not x.ahead.sent
        engine.resident.discard(bytes(SHARED[2]))  # evicted since the index saw it
        stepping = asyncio.create_task(_stepping(engine))
        served = await _answer(d, x, "b", B_PROMPT)
        await kv.close()  # (its releases sent first)
        stepping.cancel()
        assert (x.predicted_cached_tokens, served) == (2 * BS, 2 * BS)
        assert x.headers()["x-vcache-prediction"] == "exact"

    asyncio.run(main())


def test_a_hold_refused_or_failed_ahead_leaves_the_prediction_approximate(
    tmp_path: Path,
) -> None:
    async def main(engine: Core, sub: str) -> tuple[Dispatch, int]:
        (tmp_path / sub).mkdir()
        d, kv = _dispatcher(engine, tmp_path / sub)
        stepping = asyncio.create_task(_stepping(engine))
        x = await d.route(_greq("b", B_PROMPT), None)
        assert x.ahead is not None
        served = await _answer(d, x, "b", B_PROMPT)
        await kv.holds.flush()
        stepping.cancel()
        await kv.close()
        assert not any(kv.holds.held.values()) and engine.holds == {}
        return x, served

    small = Core(SHARED, num_blocks=8)  # 25% of 8: two blocks, three asked
    x, served = asyncio.run(main(small, "budget"))
    assert (x.approximate, x.predicted_cached_tokens) == ("hold_budget", 3 * BS)
    assert prediction_result(x, served) == ("approximate", "hold_budget")
    assert x.headers()["x-vcache-prediction"] == "approximate"

    broken = Core(SHARED, fail=True)  # the plugin fails the call
    x, _ = asyncio.run(main(broken, "failed"))
    assert (x.approximate, x.predicted_cached_tokens) == ("hold_failed", 3 * BS)

    dead = Core(SHARED)
    dead.send_fails = True  # the send itself fails: the request goes, unheld
    x, _ = asyncio.run(main(dead, "unsent"))
    assert (x.approximate, x.predicted_cached_tokens) == ("hold_failed", 3 * BS)
    assert [w for _, w in dead.applied] == ["add:b"]


def test_the_hold_is_given_back_on_every_path(tmp_path: Path) -> None:
    """Never sent (the journal failed before the send): nothing to release.  Sent and the
    request cancelled before its answer was read, or failed in the engine: its id is
    released, after the hold (same channel), and nothing is counted as held."""

    async def main() -> None:
        engine = Core(SHARED)
        d, kv = _dispatcher(engine, tmp_path)
        stepping = asyncio.create_task(_stepping(engine))

        unsent = await d.route(_greq("a", A_PROMPT), None)
        d.release(unsent)
        await kv.holds.flush()
        assert unsent.ahead is not None and unsent.ahead.given and engine.applied == []

        cancelled = await d.route(_greq("b", B_PROMPT), None)
        stepping.cancel()  # the core is busy with a step: nothing is applied meanwhile
        reading = asyncio.create_task(_answer(d, cancelled, "b", B_PROMPT))
        await until(lambda: len(engine.inputs) == 2, "the hold and the request sent")
        assert [w for w, _, _ in engine.inputs] == ["vcache_hold", "add:b"]
        reading.cancel()  # the client went away
        await asyncio.wait({reading})
        assert kv.holds.pending() == 1 and kv.holds.held == {}
        stepping = asyncio.create_task(_stepping(engine))
        await kv.holds.flush()
        await until(lambda: engine.holds == {}, "released in the engine")
        assert engine.when("vcache_hold") <= engine.when("vcache_release")

        engine.request_fails = True
        failed = await d.route(_greq("c", B_PROMPT), None)
        with pytest.raises(Unavailable, match="died"):
            await _answer(d, failed, "c", B_PROMPT)
        await kv.holds.flush()
        await until(lambda: engine.holds == {}, "released in the engine")
        assert kv.holds.held == {} and kv.holds.pending() == 0
        assert [w for _, w in engine.applied].count("vcache_release") == 2
        stepping.cancel()
        await kv.close()

    asyncio.run(main())


def test_serial_where_the_hold_cannot_ride_with_the_request(tmp_path: Path) -> None:
    """Awaited while routing, as before: a remote-like engine (no ordered channel); a
    running prefill of the request's blocks; holds off; a cold prediction (no call)."""

    async def main() -> None:
        remote = Core(SHARED, ordered=False)
        d, kv = _dispatcher(remote, tmp_path)
        stepping = asyncio.create_task(_stepping(remote))
        x = await d.route(_greq("b", B_PROMPT), None)
        assert x.ahead is None and x.approximate == "" and x.predicted_cached_tokens == 3 * BS
        assert [w for _, w in remote.applied] == ["vcache_hold"]
        d.release(x)
        await kv.holds.flush()
        stepping.cancel()
        await kv.close()

        (tmp_path / "p").mkdir()
        engine = Core(SHARED)
        d, kv = _dispatcher(engine, tmp_path / "p", prefill_wait_s=0.05)
        stepping = asyncio.create_task(_stepping(engine))
        blocks = block_hashes(list(A_PROMPT), BS, "0")[: (len(A_PROMPT) - 1) // BS]
        running = d.prefills.start(R, blocks)  # A's prefill of the three, still running
        x = await d.route(_greq("b", B_PROMPT), None)
        assert x.ahead is None and x.approximate == ""  # held as many as A stores: exact
        assert [w for _, w in engine.applied] == ["vcache_hold"]
        d.release(x)
        d.prefills.finish(running)
        await kv.holds.flush()
        stepping.cancel()
        await kv.close()

        (tmp_path / "o").mkdir()
        (tmp_path / "c").mkdir()
        for sub, resident, share in (("o", SHARED, 0.0), ("c", [], 0.25)):
            engine = Core(resident)
            d, kv = _dispatcher(engine, tmp_path / sub, hold_share=share)
            x = await d.route(_greq("b", B_PROMPT), None)
            assert x.ahead is None and engine.inputs == []
            d.release(x)
            await kv.close()

    asyncio.run(main())


def test_span_control_sends_ahead_only_on_an_engine_that_orders() -> None:
    class CallsOnly:  # a remote replica: its control endpoint has no order with requests
        async def call_core(self, method: str, *args: Any) -> Any:
            return {}

    class Closed(CallsOnly):
        core_ordered = False

        def send_core(self, method: str, *args: Any) -> Awaitable[Any]:
            raise AssertionError("not ordered: nothing sent")

    assert not SpanControl(CallsOnly()).ordered
    assert not SpanControl(Closed()).ordered
    assert SpanControl(Core([])).ordered


def test_a_result_read_after_the_receipt_was_given_holds_nothing(tmp_path: Path) -> None:
    async def main() -> None:
        engine = Core(SHARED)
        _, kv = _dispatcher(engine, tmp_path)
        pending = kv.holds.ahead(R, SHARED, 0.25, 1, 10)
        pending.send()
        pending.send()  # once
        reading = asyncio.ensure_future(pending.result())
        await asyncio.sleep(0)
        pending.give()  # before the answer
        engine.step()
        got = await reading
        assert got == HoldResult(None, 3, "") and kv.holds.held == {}
        assert kv.holds.pending() == 1  # its id released
        assert [w for w, _, _ in engine.inputs] == [] and len(engine.holds) == 1
        stepping = asyncio.create_task(_stepping(engine))
        await kv.close()  # (its releases sent first)
        stepping.cancel()
        assert engine.holds == {}

    asyncio.run(main())
