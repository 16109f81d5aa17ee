"""A warm request's hold carried in the request itself, taken by its engine core.

The core below applies what reaches its input between two engine steps, in the order
it was sent (as vLLM's engine core does): a hold carried in a request is taken as the
core queues the request, at the same step boundary, and let go by the core once it
schedules the request (engines/vllm/core_holds.py); its answer comes on the first
chunk.  A hold awaited while routing (a core call) is applied one boundary earlier,
and the request waits for the next one.  Either way the hold is taken before the
request is queued, so what the engine serves equals the prediction.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Coroutine, Sequence
from pathlib import Path
from typing import Any

import pytest

from engines.base import GenerateChunk, GenerateRequest
from engines.errors import EngineUnavailable
from engines.vllm.span_control import SpanControl
from gateway.core.errors import Unavailable
from gateway.local.dispatch import Dispatch, Dispatcher, Totals, prediction_result
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
    order they are sent; :meth:`step` applies them (a step boundary).  ``carries``: its
    core takes a hold carried in a request, as the embedded engine's does; else (a
    remote replica) holds are core calls only.  ``answers``: the core answers a carried
    hold on the first chunk (False: an engine that lost the answer)."""

    def __init__(
        self,
        resident: Sequence[bytes],
        carries: bool = True,
        pressure: bool = False,
        answers: bool = True,
        **options: Any,
    ) -> None:
        super().__init__(resident, **options)
        self.holds_in_request = carries
        self.answers = answers
        self.pressed = pressure  # requests that ran before it was scheduled took every free block
        self.inputs: list[tuple[str, Any, asyncio.Future[Any]]] = []
        self.applied: list[tuple[int, str]] = []  # (step boundary, what it applied)
        self.steps = 0
        self.request_fails = False  # the request fails in the engine after it is queued

    async def call_core(self, method: str, *args: Any) -> Any:
        if method == "vcache_events_barrier":
            return -1
        reply = asyncio.get_running_loop().create_future()
        self.inputs.append((method, args, reply))
        return await reply

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[GenerateChunk, None]:
        queued = asyncio.get_running_loop().create_future()
        self.inputs.append((f"add:{request.request_id}", request, queued))
        cached, answer = await queued
        if self.request_fails:
            raise EngineUnavailable("the engine process died")
        prompt = len(request.prompt_token_ids)
        yield GenerateChunk("x", (1,), prompt, cached, finish_reason="stop", hold=answer)

    def _add(self, request: GenerateRequest) -> tuple[int, tuple[int, str] | None]:
        """Queue ``request`` (its carried hold taken first), schedule it (the hold let go:
        the request references its blocks now): (cached tokens, the hold's answer)."""
        rid, h = request.request_id, request.hold
        answer = None
        if h is not None and self.holds_in_request:
            try:
                res = _at_once(
                    SimEngine.call_core(
                        self, "vcache_hold", rid, list(h.hashes), h.max_share, h.reserve, h.ttl_s
                    )
                )
                answer = (int(res["held"]), str(res["refused"]))
            except RuntimeError:  # the plugin's own failure
                answer = (0, "failed")
        if self.pressed:
            self.pressure()
        cached = self.schedule(request.prompt_token_ids)
        if not self.fail:
            _at_once(SimEngine.call_core(self, "vcache_release", [rid]))
        return cached, answer if self.answers else None

    def step(self) -> None:
        inputs, self.inputs = self.inputs, []
        for what, args, reply in inputs:
            self.applied.append((self.steps, what))
            if reply.cancelled():
                continue
            if what.startswith("add:"):
                reply.set_result(self._add(args))
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


def test_the_hold_rides_in_its_request_one_step_sooner_and_is_its_prediction(
    tmp_path: Path,
) -> None:
    """Routed warm (three blocks), its hold is not awaited: it rides in the request and
    is taken as the core queues it.  Every free block is taken before vLLM schedules
    it; held, the three stay: predicted 48, served 48, exact, with no core call and no
    release from the gateway.  Awaited (an engine whose core takes no hold in a
    request), the request reaches the core one boundary after the hold's call, with the
    same prediction."""

    async def main(carries: bool) -> tuple[list[str], Dispatch, int]:
        engine = Core(SHARED, carries=carries, pressure=True)
        d, kv = _dispatcher(engine, tmp_path / str(carries))
        stepping = asyncio.create_task(_stepping(engine))
        x = await d.route(_greq("b", B_PROMPT), None)
        routed = [w for _, w in engine.applied]
        served = await _answer(d, x, "b", B_PROMPT)
        await kv.holds.flush()
        await until(lambda: engine.holds == {}, "let go in the engine")
        stepping.cancel()
        await kv.close()
        assert kv.holds.pending() == 0 and not any(kv.holds.held.values())
        results = d._metrics.registry.get_sample_value
        assert results("vcache_prediction_results_total", {"result": "exact", "cause": ""}) == 1
        assert results("vcache_kv_holds_total", {"replica": R, "outcome": "held"}) == 1
        return routed, x, served

    (tmp_path / "True").mkdir()
    (tmp_path / "False").mkdir()
    routed, x, served = asyncio.run(main(carries=True))
    assert routed == []  # routing sent nothing and waited for no step
    assert (x.predicted_cached_tokens, served) == (3 * BS, 3 * BS)
    assert x.headers()["x-vcache-prediction"] == "exact" and x.approximate == ""
    assert prediction_result(x, served) == ("exact", "")

    engine_calls = Core(SHARED, carries=False)
    assert not SpanControl(engine_calls).in_request
    routed, x, served = asyncio.run(main(carries=False))
    assert routed == ["vcache_hold"]  # held while routing: the request a step later
    assert (x.predicted_cached_tokens, served) == (3 * BS, 3 * BS) and x.approximate == ""


def test_the_carried_hold_is_taken_with_its_request_and_released_by_the_core(
    tmp_path: Path,
) -> None:
    """What reaches the core: the request alone, its hold inside it (the blocks the index
    predicted, the share, the reserve, the bound), and no release afterwards."""

    async def main() -> None:
        engine = Core(SHARED)
        d, kv = _dispatcher(engine, tmp_path)
        x = await d.route(_greq("b", B_PROMPT), None)
        assert x.carried is not None
        own = block_hashes(list(B_PROMPT), BS, "0")[: (len(B_PROMPT) - 1) // BS]
        assert x.carried.hashes == tuple(bytes(h) for h in own)  # its prompt's, from the first
        assert (x.carried.max_share, x.carried.reserve) == (0.25, 2048 // BS)
        stepping = asyncio.create_task(_stepping(engine))
        await _answer(d, x, "b", B_PROMPT)
        await kv.close()
        stepping.cancel()
        assert [w for _, w in engine.applied] == ["add:b"] and engine.holds == {}

    asyncio.run(main())


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
        assert x.carried is not None and engine.inputs == []
        engine.resident.discard(bytes(SHARED[2]))  # evicted since the index saw it
        stepping = asyncio.create_task(_stepping(engine))
        served = await _answer(d, x, "b", B_PROMPT)
        await kv.close()
        stepping.cancel()
        assert (x.predicted_cached_tokens, served) == (2 * BS, 2 * BS)
        assert x.headers()["x-vcache-prediction"] == "exact"

    asyncio.run(main())


def test_a_carried_hold_refused_failed_or_unanswered_leaves_the_prediction_approximate(
    tmp_path: Path,
) -> None:
    async def main(engine: Core, sub: str) -> tuple[Dispatch, int]:
        (tmp_path / sub).mkdir()
        d, kv = _dispatcher(engine, tmp_path / sub)
        stepping = asyncio.create_task(_stepping(engine))
        x = await d.route(_greq("b", B_PROMPT), None)
        assert x.carried is not None
        served = await _answer(d, x, "b", B_PROMPT)
        stepping.cancel()
        await kv.close()
        assert engine.holds == {} and [w for _, w in engine.applied] == ["add:b"]
        return x, served

    small = Core(SHARED, num_blocks=8)  # 25% of 8: two blocks, three asked
    x, served = asyncio.run(main(small, "budget"))
    assert (x.approximate, x.predicted_cached_tokens) == ("hold_budget", 3 * BS)
    assert prediction_result(x, served) == ("approximate", "hold_budget")
    assert x.headers()["x-vcache-prediction"] == "approximate"

    broken = Core(SHARED, fail=True)  # the plugin fails the hold
    x, _ = asyncio.run(main(broken, "failed"))
    assert (x.approximate, x.predicted_cached_tokens) == ("hold_failed", 3 * BS)

    silent = Core(SHARED, answers=False)  # the answer never came
    x, served = asyncio.run(main(silent, "unanswered"))
    assert (x.approximate, x.predicted_cached_tokens) == ("hold_unanswered", 3 * BS)
    assert served == 3 * BS  # held all the same: only the answer is missing


def test_nothing_to_give_back_on_any_path(tmp_path: Path) -> None:
    """Never sent (the journal failed before the send): nothing reached the core.  Sent
    and the client gone before the core applied it, or failed in the engine: the core
    owns the hold and lets it go; the gateway has nothing to release."""

    async def main() -> None:
        engine = Core(SHARED)
        d, kv = _dispatcher(engine, tmp_path)
        stepping = asyncio.create_task(_stepping(engine))

        unsent = await d.route(_greq("a", A_PROMPT), None)
        d.release(unsent)
        await kv.holds.flush()
        assert unsent.carried is not None and engine.applied == []

        cancelled = await d.route(_greq("b", B_PROMPT), None)
        stepping.cancel()  # the core is busy with a step: nothing is applied meanwhile
        reading = asyncio.create_task(_answer(d, cancelled, "b", B_PROMPT))
        await until(lambda: len(engine.inputs) == 1, "the request sent")
        assert [w for w, _, _ in engine.inputs] == ["add:b"]
        reading.cancel()  # the client went away
        await asyncio.wait({reading})
        stepping = asyncio.create_task(_stepping(engine))
        await until(lambda: engine.steps > 2, "steps applied")
        assert kv.holds.pending() == 0 and engine.holds == {}

        engine.request_fails = True
        failed = await d.route(_greq("c", B_PROMPT), None)
        with pytest.raises(Unavailable, match="died"):
            await _answer(d, failed, "c", B_PROMPT)
        assert kv.holds.pending() == 0 and engine.holds == {}
        assert "vcache_release" not in [w for _, w in engine.applied]
        stepping.cancel()
        await kv.close()

    asyncio.run(main())


def test_serial_where_the_hold_cannot_ride_in_the_request(tmp_path: Path) -> None:
    """Awaited while routing, as before: a remote-like engine (its core takes no hold in
    a request); a running prefill of the request's blocks; holds off; a cold prediction
    (no call)."""

    async def main() -> None:
        remote = Core(SHARED, carries=False)
        d, kv = _dispatcher(remote, tmp_path)
        stepping = asyncio.create_task(_stepping(remote))
        x = await d.route(_greq("b", B_PROMPT), None)
        assert x.carried is None and x.approximate == "" and x.predicted_cached_tokens == 3 * BS
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
        assert x.carried is None and x.approximate == ""  # held as many as A stores: exact
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
            assert x.carried is None and engine.inputs == []
            d.release(x)
            await kv.close()

    asyncio.run(main())


def test_span_control_carries_holds_only_where_the_engine_takes_them() -> None:
    class CallsOnly:  # a remote replica: holds are calls to its control endpoint
        async def call_core(self, method: str, *args: Any) -> Any:
            return {}

    class Closed(CallsOnly):
        holds_in_request = False

    assert not SpanControl(CallsOnly()).in_request
    assert not SpanControl(Closed()).in_request
    assert SpanControl(Core([])).in_request
