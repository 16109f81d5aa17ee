"""Load-test workloads and summaries (pure parts)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtests.report import counter_cross_check, percentile, summarize
from loadtests.workloads import (
    Workload,
    long_document_qa,
    multi_turn,
    shared_prefix,
    zero_reuse,
    zipf_weights,
)


def test_zipf_weights_are_explicit_for_any_skew() -> None:
    flat = zipf_weights(4, 0.0)
    assert flat == [0.25] * 4
    w = zipf_weights(3, 1.0)
    assert w == pytest.approx([1 / (11 / 6), 0.5 / (11 / 6), (1 / 3) / (11 / 6)])
    assert sum(zipf_weights(100, 0.8)) == pytest.approx(1.0)


def test_same_seed_and_run_id_give_the_same_bytes(tmp_path: Path) -> None:
    a = shared_prefix(3, 50, 5, 4, 20, 1.2, seed=1, run_id="r1")
    b = shared_prefix(3, 50, 5, 4, 20, 1.2, seed=1, run_id="r1")
    c = shared_prefix(3, 50, 5, 4, 20, 1.2, seed=1, run_id="r2")
    assert a == b and a != c
    a.dump(tmp_path / "w.json")
    assert Workload.load(tmp_path / "w.json") == a


def test_shapes() -> None:
    fan = shared_prefix(4, 50, 5, 4, 40, 2.0, seed=3, run_id="x")
    systems = {s.system for s in fan.sessions}
    assert len(fan.sessions) == 40 and len(systems) <= 4
    assert all(s.system and s.system.startswith("[run x] ") for s in fan.sessions)
    chat = multi_turn(3, 4, 50, 5, 4, 0.5, seed=3, run_id="x")
    assert [len(s.turns) for s in chat.sessions] == [4, 4, 4]
    assert [t.label for t in chat.sessions[0].turns] == ["turn-0", "turn-1", "turn-2", "turn-3"]
    qa = long_document_qa(2, 80, 3, 5, 4, interleaved=True, seed=3, run_id="x")
    assert [s.turns[0].label for s in qa.sessions] == ["doc-0", "doc-1"] * 3
    unique = zero_reuse(5, 30, 4, seed=3, run_id="x")
    firsts = {s.turns[0].user.split(":")[0] for s in unique.sessions}
    assert len(firsts) == 5  # every prompt differs from its first words on


def test_token_budget_is_respected_with_a_tokenizer() -> None:
    def count(text: str) -> int:
        return len(text)  # a "tokenizer" of one token per character

    w = shared_prefix(1, 100, 20, 4, 3, 1.0, seed=5, run_id="x", count=count)
    body = w.sessions[0].system or ""
    assert len(body) <= len("[run x] ") + 100
    assert all(len(s.turns[0].user) <= 20 for s in w.sessions)


def test_summary_and_counters() -> None:
    def row(ok: str, ttft: str, prompt: str, cached: str) -> dict[str, str]:
        fields = ("ok", "label", "ttft_ms", "itl_mean_ms", "prompt_tokens", "cached_tokens")
        return dict(
            zip(fields, (ok, "g", ttft, "2" if ok == "1" else "", prompt, cached), strict=True)
        )

    rows = [row("1", "10", "100", "0"), row("1", "20", "100", "50"), row("1", "30", "100", "100")]
    rows.append(row("0", "", "", ""))
    s = summarize(rows, duration_s=2.0)
    assert (s["requests"], s["errors"]) == (3, 1)
    assert s["hit_rate"] == 0.5
    assert s["ttft_ms"] == {"p50": 20.0, "p90": 30.0, "p99": 30.0}
    assert s["requests_per_s"] == 1.5
    assert percentile([], 50) is None
    before = {"vcache_prompt_tokens_total": 10.0, "vcache_cached_tokens_total": 0.0}
    after = {"vcache_prompt_tokens_total": 310.0, "vcache_cached_tokens_total": 150.0}
    assert counter_cross_check(before, after)["gateway_hit_rate"] == 0.5


def test_the_hit_rate_curve_counts_from_the_first_request_sent() -> None:
    from loadtests.plots import hit_rate_curve, run_start

    rows = [  # t: when each request completed; total_ms: how long it took
        {"ok": "1", "t": "100.5", "total_ms": "500", "prompt_tokens": "100", "cached_tokens": "0"},
        {
            "ok": "1",
            "t": "101.0",
            "total_ms": "200",
            "prompt_tokens": "100",
            "cached_tokens": "100",
        },
        {"ok": "0", "t": "102.0", "total_ms": "50", "prompt_tokens": "", "cached_tokens": ""},
    ]
    assert run_start(rows) == 100.0  # the first request was sent at 100.0, not 100.5
    xs, ys = hit_rate_curve(rows)
    assert xs == [0.5, 1.0] and ys == [0.0, 0.5]
