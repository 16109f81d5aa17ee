"""Holds carried in requests, in the engine core (engines/vllm/core_holds.py), on vLLM's
own BlockPool: taken as the scheduler adds the request, kept until it schedules it (or
the request ends first), answered on the request's first outputs."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from engines.vllm import core_holds
from engines.vllm.core_holds import ANSWERED_OUTPUTS, HOLD_ARG
from tests.unit.engines.test_plugin_request_holds import H, _cached, _core, _pressure
from tests.unit.engines.test_top_prefill import _request as _vllm_request
from tests.unit.engines.test_top_prefill import _scheduler

pytest.importorskip("vllm.v1.core.block_pool")


def _sched(cached: int, blocks: int = 12) -> tuple[Any, Any]:
    core, pool = _core(cached, blocks)
    core.scheduler.requests = {}
    return core.scheduler, pool


def _request(rid: str, ask: Any = None) -> Any:
    extra = None if ask is None else {HOLD_ARG: ask}
    return SimpleNamespace(request_id=rid, sampling_params=SimpleNamespace(extra_args=extra))


def _add(sched: Any, request: Any) -> None:
    core_holds.on_add(sched, request)
    sched.requests[request.request_id] = request


def _outputs(*rids: str) -> dict[int, Any]:
    outs = [SimpleNamespace(request_id=r, kv_transfer_params=None) for r in rids]
    return {0: SimpleNamespace(outputs=outs)}


def _answers(sched: Any, *rids: str) -> list[Any]:
    outputs = _outputs(*rids)
    core_holds.on_outputs(sched, outputs)
    return [o.kv_transfer_params for o in outputs[0].outputs]


def test_taken_as_the_request_is_added_and_let_go_once_it_is_scheduled() -> None:
    sched, pool = _sched(cached=4)
    _add(sched, _request("r", [H[:3], 0.5, 0, 10]))
    _pressure(pool)
    assert _cached(pool) == H[:3]  # held: the fourth, not asked for, was taken
    assert core_holds.counts(sched) == (3, 1)
    core_holds.on_scheduled(sched, {"other": 4})
    assert core_holds.counts(sched) == (3, 1)  # not its step yet
    core_holds.on_scheduled(sched, {"r": 16})  # it references its blocks itself now
    assert core_holds.counts(sched) == (0, 0)
    _pressure(pool)
    assert _cached(pool) == []


def test_the_answer_rides_on_its_first_outputs_only() -> None:
    sched, _ = _sched(cached=4)
    _add(sched, _request("r", [H[:6], 0.5, 0, 10]))
    _add(sched, _request("plain"))
    core_holds.on_scheduled(sched, {"r": 16, "plain": 16})
    for _ in range(ANSWERED_OUTPUTS):  # merged by a slow reader, it is still there
        assert _answers(sched, "plain", "r") == [None, {HOLD_ARG: [4, ""]}]
    assert _answers(sched, "r") == [None]


def test_a_refused_hold_holds_nothing_and_says_why() -> None:
    sched, _ = _sched(cached=6)
    _add(sched, _request("r", [H[:6], 0.25, 0, 10]))  # 6 > 25% of 12
    assert core_holds.counts(sched) == (0, 0)
    assert _answers(sched, "r") == [{HOLD_ARG: [0, "budget"]}]
    _add(sched, _request("bad", ["not", "an", "ask"]))  # malformed: nothing held
    assert _answers(sched, "bad") == [{HOLD_ARG: [0, "failed"]}]


def test_a_request_aborted_or_gone_before_it_ran_lets_its_hold_go() -> None:
    sched, pool = _sched(cached=4)
    _add(sched, _request("aborted", [H[:2], 0.5, 0, 10]))
    _add(sched, _request("gone", [H[:4], 0.5, 0, 10]))
    core_holds.on_finished(sched, ["aborted"])
    del sched.requests["aborted"]
    assert core_holds.counts(sched) == (4, 1) and _answers(sched, "aborted") == [None]
    del sched.requests["gone"]  # finished some other way
    core_holds.on_scheduled(sched, {})
    assert core_holds.counts(sched) == (0, 0)
    _answers(sched)  # a step with no output of it: its answer dropped
    assert _answers(sched, "gone") == [None]
    _pressure(pool)
    assert _cached(pool) == []


def test_a_request_finished_by_its_first_output_still_gets_the_answer() -> None:
    sched, _ = _sched(cached=4)
    _add(sched, _request("r", [H[:2], 0.5, 0, 10]))
    core_holds.on_scheduled(sched, {"r": 16})
    del sched.requests["r"]  # vLLM frees a finished request before returning its outputs
    assert _answers(sched, "r") == [{HOLD_ARG: [2, ""]}]


def test_a_streamed_inputs_next_chunk_is_not_held_again() -> None:
    sched, _ = _sched(cached=4)
    _add(sched, _request("r", [H[:2], 0.5, 0, 10]))
    core_holds.on_add(sched, _request("r", [H[:2], 0.5, 0, 10]))  # the same id again
    assert core_holds.counts(sched) == (2, 1)


def test_vcaches_scheduler_takes_lets_go_and_answers(demo_model: Path) -> None:
    """On vcache's scheduler class (vLLM's own, built over the demo model's config, stepped
    without a model): a prompt computed and aborted leaves its blocks cached and free;
    the next request of that prefix carries a hold on them, taken as it is added; once
    scheduled it reads them and the hold is gone; its first output carries the answer."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import RequestStatus

    s = _scheduler(demo_model, 100)
    first = _vllm_request("first", 64, 0, ids=list(range(64)))
    s.add_request(first)
    s.schedule()
    s.finish_requests("first", RequestStatus.FINISHED_ABORTED)  # 4 blocks cached, free
    ask = [[bytes(h) for h in first.block_hashes[:3]], 0.5, 0, 10]
    second = _vllm_request("second", 72, 0, ids=list(range(72)))
    second.sampling_params = SamplingParams(max_tokens=8, extra_args={HOLD_ARG: ask})
    s.add_request(second)
    assert core_holds.counts(s) == (3, 1)
    out = s.schedule()
    assert out.num_scheduled_tokens["second"] == 72 - 64  # read the four cached blocks
    assert core_holds.counts(s) == (0, 0)
    ran = ModelRunnerOutput(
        req_ids=["second"], req_id_to_index={"second": 0}, sampled_token_ids=[[7]]
    )
    outputs = s.update_from_output(out, ran)
    (answer,) = [o.kv_transfer_params for b in outputs.values() for o in b.outputs]
    assert answer == {HOLD_ARG: [3, ""]}

    third = _vllm_request("third", 72, 0, ids=list(range(72)))
    third.sampling_params = SamplingParams(max_tokens=8, extra_args={HOLD_ARG: ask})
    s.add_request(third)
    assert core_holds.counts(s) == (3, 1)
    s.finish_requests(["third"], RequestStatus.FINISHED_ABORTED)  # the client left first
    assert core_holds.counts(s) == (0, 0)
