"""The frontend bench's arithmetic: rows from slices, the ratios to vLLM's server, the
table, the profile's shares from py-spy's collapsed stacks, and that its arms and loads
are the issue's."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.core.config import Settings
from loadtests.bench_frontend import (
    ARMS,
    LOADS,
    VLLM,
    Answer,
    Row,
    Slice,
    _vllm_cmd,
    by_thread,
    is_engine,
    misses,
    own_by_file,
    question,
    ratios,
    request_body,
    round_ratios,
    summarize,
    system_prompts,
    table,
    thread_cpu,
    thread_names,
    top_costs,
    ttft_phases,
)


def _slice(cpu_s: float, wall_s: float, answers: list[Answer], load: float = 1.0) -> Slice:
    return Slice(wall_s, cpu_s, {1: cpu_s}, answers, 0, (load, load + 0.5), "14:00", cpu_s / 4)


def test_a_row_sums_cpu_and_wall_over_slices_and_ranks_every_answer() -> None:
    a = [Answer(0.1 * i, 0.5 + 0.1 * i, 64, 60) for i in range(1, 6)]  # ttft 100..500 ms
    b = [Answer(0.6, 1.2, 64, 64), Answer(0.7, 1.3, 64, 64)]
    row = summarize([_slice(0.35, 2.0, a), _slice(0.14, 1.5, b, load=3.0)])
    assert row.requests == 7 and row.tokens == 7 * 64
    assert row.cpu_ms_per_request == pytest.approx(490 / 7)
    assert row.cpu_us_per_token == pytest.approx(0.49 / 448 * 1e6)
    assert row.tokens_per_s == pytest.approx(448 / 3.5)
    assert row.requests_per_s == pytest.approx(2.0)
    assert row.ttft_p50_ms == pytest.approx(400)  # nearest rank: 4th of 7
    assert row.ttft_p90_ms == pytest.approx(700)
    assert row.e2e_p50_ms == pytest.approx(900)
    assert row.events_per_request == pytest.approx((5 * 60 + 2 * 64) / 7)
    assert row.load_avg_max == pytest.approx(3.5)
    assert row.sys_share == pytest.approx(0.25)
    assert [s["wall_s"] for s in row.slices] == [2.0, 1.5]


def test_a_row_has_the_engines_cpu_a_request_and_a_streamed_answers_time_a_token() -> None:
    streamed = [Answer(0.1, 0.1 + 0.004 * 63, 64, 20), Answer(0.2, 0.2 + 0.006 * 63, 64, 18)]
    whole = [Answer(0.3, 0.3, 32, 1)]  # one event: no time between tokens to read
    one = Slice(1.0, 0.2, {1: 0.2}, streamed, 0, engine_s=0.03)
    two = Slice(1.0, 0.1, {1: 0.1}, whole, 0, engine_s=0.015)
    row = summarize([one, two])
    assert row.engine_ms_per_request == pytest.approx(45 / 3)
    assert row.tpot_p50_ms == pytest.approx(4.0)  # nearest rank of the two streamed answers
    assert summarize([two]).tpot_p50_ms == 0.0


def test_no_slices_is_an_empty_row_not_a_division_by_zero() -> None:
    row = summarize([])
    assert row.requests == 0 and row.cpu_us_per_token == 0.0 and row.tokens_per_s == 0.0


def test_ratios_are_the_gateway_over_vllm_and_none_where_vllm_has_nothing() -> None:
    vllm = Row(cpu_us_per_token=200, cpu_ms_per_request=10, ttft_p50_ms=400, ttft_p90_ms=0)
    vllm.e2e_p50_ms, vllm.tokens_per_s = 500, 1000
    gw = Row(cpu_us_per_token=140, cpu_ms_per_request=9, ttft_p50_ms=300, ttft_p90_ms=800)
    gw.e2e_p50_ms, gw.tokens_per_s = 450, 1250
    x = ratios(gw, vllm)
    assert x["cpu_us_per_token"] == pytest.approx(0.7)
    assert x["cpu_ms_per_request"] == pytest.approx(0.9)
    assert x["ttft_p50_ms"] == pytest.approx(0.75)
    assert x["ttft_p90_ms"] is None
    assert x["e2e_p50_ms"] == pytest.approx(0.9)
    assert x["tokens_per_s"] == pytest.approx(1.25)


def test_the_table_puts_vllm_first_and_each_gateway_with_its_ratios() -> None:
    vllm = Row(requests=10, cpu_us_per_token=200, cpu_ms_per_request=10, tokens_per_s=1000)
    vllm.ttft_p50_ms = vllm.ttft_p90_ms = vllm.e2e_p50_ms = 100
    gw = Row(requests=10, cpu_us_per_token=300, cpu_ms_per_request=15, tokens_per_s=850)
    gw.ttft_p50_ms = gw.ttft_p90_ms = gw.e2e_p50_ms = 120
    gw.errors = 2
    lines = table({"streamed": {"vcache": gw, VLLM: vllm}}).splitlines()
    assert lines[1].split()[:2] == ["streamed", VLLM]
    assert lines[2].split()[:2] == ["streamed", "vcache"]
    assert lines[3].split() == ["ratio", "to", "vllm", "1.50x", "1.50x"] + ["1.20x"] * 3 + ["0.85x"]
    assert lines[4].split() == ["2", "requests", "failed"]


def test_each_rounds_cpu_ratio_pairs_the_slices_of_one_round() -> None:
    def row(*cpu_s: float) -> Row:
        answers = [Answer(0.1, 0.5, 32, 1) for _ in range(4)]  # 128 tokens a slice
        return summarize([_slice(c, 1.0, answers) for c in cpu_s])

    vllm, gw = row(0.4, 0.5, 0.4), row(0.3, 0.3, 0.36)
    assert round_ratios(gw, vllm) == pytest.approx([0.75, 0.6, 0.9])
    assert round_ratios(gw, summarize([])) == []
    lines = table({"whole": {"vcache": gw, VLLM: vllm}}).splitlines()
    assert lines[4].split() == ["CPU/token", "by", "round", "0.60-0.90x,", "median", "0.75x"]


STACKS = [
    "<module> (/x/lib/python3.12/asyncio/runners.py:118);_run (/x/lib/python3.12/asyncio/"
    "events.py:84);relay (/work/main/gateway/service/chat.py:10) 30",
    "<module> (/x/lib/python3.12/asyncio/runners.py:118);_run (/x/lib/python3.12/asyncio/"
    "events.py:84);relay (/work/main/gateway/service/chat.py:12);dumps "
    "(/v/site-packages/orjson/__init__.py:3) 50",
    "<module> (/x/lib/python3.12/asyncio/runners.py:118);select (/x/lib/python3.12/"
    "selectors.py:468) 20",
    "garbage line without a count",
]


def test_top_costs_share_samples_by_function_across_line_numbers() -> None:
    total, costs = top_costs(STACKS)
    assert total == 100
    by = {c.function: c for c in costs}
    assert by["<module> (asyncio/runners.py)"].cumulative == pytest.approx(1.0)
    relay = by["relay (gateway/service/chat.py)"]  # its two lines, one function
    assert relay.cumulative == pytest.approx(0.8) and relay.own == pytest.approx(0.3)
    assert by["dumps (orjson/__init__.py)"].own == pytest.approx(0.5)
    assert by["select (selectors.py)"].cumulative == pytest.approx(0.2)
    # _run is on exactly relay's stacks: the chain is listed by its innermost function
    assert "_run (asyncio/events.py)" not in by
    assert [c.cumulative for c in costs] == sorted((c.cumulative for c in costs), reverse=True)
    assert top_costs([]) == (0, [])


def test_own_by_file_is_the_top_frames_file() -> None:
    shares = dict(own_by_file(STACKS))
    assert shares["orjson/__init__.py"] == pytest.approx(0.5)
    assert shares["selectors.py"] == pytest.approx(0.2)
    assert sum(shares.values()) == pytest.approx(1.0)


def test_threads_are_stack_roots_and_not_functions() -> None:
    threaded = [
        "thread (11): MainThread;run (uvloop/__init__.py:1);relay (gateway/service/chat.py:3) 6",
        "thread (12): render;Thread.run (threading.py:9);encode (tokenizers/x.py:4) 3",
        "thread (12): render;Thread.run (threading.py:9) 1",
    ]
    assert by_thread(threaded) == [("MainThread", 0.6), ("render", 0.4)]
    total, costs = top_costs(threaded)
    assert total == 10 and not any(c.function.startswith("thread") for c in costs)
    assert by_thread(STACKS[:1]) == [("?", 1.0)]
    assert thread_names(threaded) == {11: "MainThread", 12: "render"}


def test_thread_cpu_is_each_threads_share_named_by_py_spy() -> None:
    before = {11: 10.0, 12: 1.0, 13: 0.5}
    after = {11: 10.6, 12: 1.3, 13: 0.6, 14: 0.0}  # 14 started and idle: no share
    shares = thread_cpu(before, after, {11: "MainThread", 12: "render"})
    assert [t for t, _ in shares] == ["MainThread", "render", "thread 13"]
    assert [round(v, 3) for _, v in shares] == [0.6, 0.3, 0.1]


def test_engine_processes_are_not_the_frontends() -> None:
    assert is_engine("VLLM::EngineCore", "")
    assert is_engine("VLLM::DPCoordinator", "")
    assert is_engine("python", "python -c from multiprocessing.resource_tracker import main")
    assert not is_engine("python", "python -m gateway.cli serve --workers 2")
    assert not is_engine("VLLM::APIServer_1", "VLLM::APIServer_1")  # vllm serve's frontends


def test_vllm_with_workers_runs_as_many_frontends() -> None:
    """``--workers 2``: vllm serve, whose --api-server-count starts two API servers (the
    deprecated api_server module would run one over both engines)."""
    one = _vllm_cmd(Path("/m"), 8000, 1, 1 << 30)
    assert one[1:5] == ["-m", "vllm.entrypoints.openai.api_server", "--model", "/m"]
    two = _vllm_cmd(Path("/m"), 8000, 2, 1 << 30)
    assert two[1] == "-c" and "ServeSubcommand.cmd(args)" in two[2]
    assert two[-4:] == ["--data-parallel-size", "2", "--api-server-count", "2"]
    assert two[3:-4] == one[3:]


def test_the_loads_and_prompts_are_the_issues() -> None:
    assert (LOADS["streamed"].max_tokens, LOADS["streamed"].concurrency) == (64, 8)
    assert (LOADS["whole"].max_tokens, LOADS["whole"].concurrency) == (32, 16)
    systems = system_prompts()
    assert len(systems) == 6 and systems == system_prompts()
    assert all(400 <= len(s.split()) <= 410 for s in systems)
    assert len(question(7).split()) == 20 and question(7) != question(8)
    body = request_body(13, LOADS["streamed"], systems)
    assert body["messages"][0]["content"] == systems[13 % 6]
    assert body["stream_options"] == {"include_usage": True} and body["ignore_eos"]
    assert "stream" not in request_body(13, LOADS["whole"], systems)


def test_every_arm_sets_settings_that_exist() -> None:
    for arm, env in ARMS.items():
        settings = Settings.model_validate({})  # the defaults
        for key, value in env.items():
            assert key.startswith("VCACHE_"), arm
            *path, leaf = key.removeprefix("VCACHE_").lower().split("__")
            node = settings
            for part in path:
                node = getattr(node, part)
            assert leaf in type(node).model_fields, (arm, key)  # else it would run defaults
            assert str(getattr(node, leaf)).lower() != value, (arm, key)  # and change one


def test_the_issues_targets_are_checked_on_every_load() -> None:
    vllm = Row(cpu_us_per_token=200, ttft_p90_ms=100, tokens_per_s=1000)
    good = Row(cpu_us_per_token=140, ttft_p90_ms=100, tokens_per_s=1000)  # exactly at bounds
    slow = Row(cpu_us_per_token=141, ttft_p90_ms=101, tokens_per_s=999)
    assert misses({"streamed": {VLLM: vllm, "vcache": good}}) == []
    missed = misses(
        {"streamed": {VLLM: vllm, "vcache": good}, "whole": {VLLM: vllm, "vcache": slow}}
    )
    assert [m.split()[:2] for m in missed] == [
        ["whole:", "cpu_us_per_token"],
        ["whole:", "ttft_p90_ms"],
        ["whole:", "tokens_per_s"],
    ]
    assert misses({"whole": {VLLM: Row(), "vcache": good}})[0].startswith(
        "whole: cpu_us_per_token -"
    )  # nothing to compare with is not a pass


def test_ttft_phases_are_means_over_every_priority_from_the_metrics() -> None:
    metrics = "\n".join(
        [
            "# TYPE vcache_ttft_phase_seconds histogram",
            'vcache_ttft_phase_seconds_bucket{le="0.01",phase="prepare",priority="batch"} 1.0',
            'vcache_ttft_phase_seconds_sum{phase="prepare",priority="interactive"} 0.03',
            'vcache_ttft_phase_seconds_count{phase="prepare",priority="interactive"} 2.0',
            'vcache_ttft_phase_seconds_sum{phase="prepare",priority="batch"} 0.01',
            'vcache_ttft_phase_seconds_count{phase="prepare",priority="batch"} 2.0',
            'vcache_ttft_phase_seconds_sum{phase="queue",priority="interactive"} 0.002',
            'vcache_ttft_phase_seconds_count{phase="queue",priority="interactive"} 1.0',
            'vcache_ttft_phase_seconds_sum{phase="gate",priority="interactive"} 0.0',
            'vcache_ttft_phase_seconds_count{phase="gate",priority="interactive"} 0.0',
        ]
    )
    got = ttft_phases(metrics)
    assert got == pytest.approx({"prepare": 10.0, "queue": 2.0})  # no request: no mean
