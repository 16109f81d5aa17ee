"""A request's outputs coalesced in the engine core by its ``stream_interval``
(engines/vllm/core_coalesce.py): what vLLM's scheduler makes each step, held back where
vLLM's output processor would hold it, so the frontend receives the outputs it lets
through and nothing else, with the same tokens and the same text."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from vllm import RequestOutput, SamplingParams
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
)
from vllm.v1.metrics.stats import SchedulerStats

from engines.vllm import core_coalesce
from engines.vllm.core_coalesce import STATE


def _params(**kw: Any) -> SamplingParams:
    fields: dict[str, Any] = {"max_tokens": 64, "output_kind": RequestOutputKind.DELTA} | kw
    return SamplingParams(**fields)


def _sched(**requests: SamplingParams) -> Any:
    reqs = {rid: SimpleNamespace(request_id=rid, sampling_params=p) for rid, p in requests.items()}
    return SimpleNamespace(requests=reqs)


def _step(sched: Any, *outs: EngineCoreOutput, stats: Any = None) -> list[EngineCoreOutput]:
    """One step's outputs through the hook: those sent to the frontend."""
    outputs = {0: EngineCoreOutputs(outputs=list(outs), scheduler_stats=stats)}
    core_coalesce.on_outputs(sched, outputs)
    return list(outputs[0].outputs) if 0 in outputs else []


def _out(rid: str, *tokens: int, **kw: Any) -> EngineCoreOutput:
    return EngineCoreOutput(request_id=rid, new_token_ids=list(tokens), **kw)


def _sent(
    sched: Any, rid: str, steps: int, end: FinishReason = FinishReason.LENGTH
) -> list[list[int]]:
    """Token ``i`` made at step ``i`` (the last one finishing it): the outputs sent."""
    sent = []
    for i in range(1, steps + 1):
        last = i == steps
        out = _out(rid, i, finish_reason=end if last else None)
        sent += [o.new_token_ids for o in _step(sched, out)]
    return sent


def test_the_first_token_then_every_n_then_the_last() -> None:
    sched = _sched(r=_params(stream_interval=4, max_tokens=10))
    assert _sent(sched, "r", 10) == [[1], [2, 3, 4, 5], [6, 7, 8, 9], [10]]
    assert getattr(sched, STATE) == {}  # nothing kept once it finished


def test_an_answer_sent_whole_is_its_first_output_and_its_last() -> None:
    sched = _sched(r=_params(stream_interval=32, max_tokens=32))
    assert _sent(sched, "r", 32) == [[1], list(range(2, 33))]


def test_an_answer_ended_by_its_stop_token_goes_out_at_once() -> None:
    """``FinishReason.STOP`` is 0: the finish is read as a finish, not as a false field."""
    sched = _sched(r=_params(stream_interval=32, max_tokens=32))
    assert _sent(sched, "r", 5, end=FinishReason.STOP) == [[1], [2, 3, 4, 5]]
    assert getattr(sched, STATE) == {}


def test_requests_vllm_must_see_each_step_of_are_sent_each_step() -> None:
    sched = _sched(
        plain=_params(),  # no interval
        one=_params(stream_interval=1),
        stops=_params(stream_interval=8, stop=["END"]),  # found as the frontend detokenizes
        lps=_params(stream_interval=8, logprobs=2),  # each step's arrays
    )
    for rid in ("plain", "one", "stops", "lps"):
        assert _sent(sched, rid, 5) == [[1], [2], [3], [4], [5]], rid


def test_an_output_carrying_more_than_tokens_goes_out_with_what_was_held() -> None:
    sched = _sched(r=_params(stream_interval=8))
    assert [o.new_token_ids for o in _step(sched, _out("r", 1))] == [[1]]
    assert _step(sched, _out("r", 2)) == [] and _step(sched, _out("r", 3)) == []
    preempted = [EngineCoreEvent.new_event(EngineCoreEventType.PREEMPTED)]
    sent = _step(sched, _out("r", 4, events=preempted))
    assert [(o.new_token_ids, o.events) for o in sent] == [([2, 3, 4], preempted)]
    assert _step(sched, _out("r", 5)) == []  # held again from there


def test_other_requests_outputs_keep_their_order_and_the_steps_stats_are_sent() -> None:
    sched = _sched(a=_params(stream_interval=4), b=_params())
    _step(sched, _out("a", 1), _out("b", 1))
    stats = SchedulerStats(num_running_reqs=2)
    outputs = {0: EngineCoreOutputs(outputs=[_out("a", 2), _out("b", 2)], scheduler_stats=stats)}
    core_coalesce.on_outputs(sched, outputs)
    assert [(o.request_id, o.new_token_ids) for o in outputs[0].outputs] == [("b", [2])]
    only_held = {0: EngineCoreOutputs(outputs=[_out("a", 3)]), 1: EngineCoreOutputs()}
    core_coalesce.on_outputs(sched, only_held)
    assert 0 not in only_held  # nothing left for that client: no message this step
    with_stats = {0: EngineCoreOutputs(outputs=[_out("a", 4)], scheduler_stats=stats)}
    core_coalesce.on_outputs(sched, with_stats)
    assert with_stats[0].outputs == [] and with_stats[0].scheduler_stats is stats


def test_an_aborted_request_drops_what_it_held() -> None:
    sched = _sched(r=_params(stream_interval=8), s=_params(stream_interval=8))
    _step(sched, _out("r", 1), _out("s", 1))
    _step(sched, _out("r", 2), _out("s", 2))
    del sched.requests["r"]  # the frontend aborted it: the scheduler lets it go
    core_coalesce.on_finished(sched, ["r"])
    held = getattr(sched, STATE)
    assert list(held) == ["s"] and held["s"].tokens == [2]
    del sched.requests["s"]  # freed without an output (an error finish)
    _step(sched)
    assert getattr(sched, STATE) == {}


def test_the_frontend_makes_the_same_answer_of_fewer_outputs(demo_model: Path) -> None:
    """vLLM's own output processor, fed each step's outputs (vLLM's scheduler) or the
    outputs left after the hook (vcache's), gives the same outputs: tokens, text and
    finish, one for one."""
    from vllm.tokenizers import get_tokenizer
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.output_processor import OutputProcessor

    tokenizer = get_tokenizer(str(demo_model))
    rng = random.Random(7)
    answers = {
        "streamed": [rng.randrange(5, 2000) for _ in range(23)],
        "whole": [rng.randrange(5, 2000) for _ in range(17)],  # ended by its stop token
        "texted": [rng.randrange(5, 2000) for _ in range(11)],
    }
    ends = {
        "streamed": FinishReason.LENGTH,
        "whole": FinishReason.STOP,
        "texted": FinishReason.LENGTH,
    }
    params = {
        "streamed": _params(stream_interval=3, max_tokens=23, detokenize=False),
        "whole": _params(stream_interval=20, max_tokens=20, detokenize=False),
        "texted": _params(stream_interval=4, max_tokens=11),
    }

    def run(coalesced: bool) -> list[tuple[str, list[int], str, bool]]:
        proc = OutputProcessor(tokenizer, log_stats=False)
        for rid, p in params.items():
            p.update_from_tokenizer(tokenizer)
            req = EngineCoreRequest(
                request_id=rid,
                prompt_token_ids=[1, 2, 3],
                mm_features=None,
                sampling_params=p,
                pooling_params=None,
                arrival_time=0.0,
                lora_request=None,
                cache_salt=None,
                data_parallel_rank=None,
                external_req_id=rid,
            )
            proc.add_request(req, None)
        sched = _sched(**params)
        got = []
        for i in range(max(len(t) for t in answers.values())):
            step = [
                _out(rid, ids[i], finish_reason=ends[rid] if i == len(ids) - 1 else None)
                for rid, ids in answers.items()
                if i < len(ids)
            ]
            outputs = {0: EngineCoreOutputs(outputs=step)}
            if coalesced:
                core_coalesce.on_outputs(sched, outputs)
            sent = outputs[0].outputs if 0 in outputs else []
            for r in proc.process_outputs(sent).request_outputs:
                assert isinstance(r, RequestOutput)  # a completion, not pooling
                c = r.outputs[0]
                got.append((r.request_id, list(c.token_ids), c.text, r.finished))
        return got

    each_step, coalesced = run(False), run(True)
    assert coalesced == each_step
    assert sum(1 for g in each_step if g[0] == "whole") == 2  # its first token, its last
    assert "".join(g[2] for g in each_step if g[0] == "texted")  # detokenized by vLLM
