"""The agent-sessions benchmark's workload (seeded, sized in tokens) and its arithmetic:
the share of reusable tokens served, TTFT of first and later turns."""

from __future__ import annotations

import argparse

from loadtests.agent_arm import summarize, workload


def _args() -> argparse.Namespace:
    return argparse.Namespace(
        seed=3,
        agent_types=2,
        system_tokens=50,
        sessions=4,
        turns=(2, 3),
        result_tokens=(5, 9),
        gap_median_s=1.0,
        gap_max_s=10.0,
        background_tokens=20,
        count=lambda text: len(text.split()),
    )


def test_the_workload_is_seeded_and_within_its_sizes() -> None:
    a, b = workload(_args(), "r1"), workload(_args(), "r1")
    assert a == b  # the same seed and run id give the same bytes
    assert [s["agent"] for s in a["sessions"]] == ["0", "1", "0", "1"]
    s0, s2 = a["sessions"][0], a["sessions"][2]
    assert s0["system"] == s2["system"] and s0["system"].startswith("[run r1]")  # one type
    for s in a["sessions"]:
        assert 2 <= len(s["turns"]) <= 3
        assert all(0 < t["gap_s"] <= 10.0 for t in s["turns"])
        assert all(5 <= len(t["result"].split()) <= 9 for t in s["turns"])
    assert a["tools"]["0"][0]["function"]["parameters"]["properties"]["step"]["enum"]
    assert workload(_args(), "r2")["sessions"][0]["system"] != s0["system"]


def test_summary_counts_reusable_tokens_of_later_turns_only() -> None:
    def row(turn: int, prompt: int, cached: int, reusable: int, ttft: float) -> dict[str, str]:
        return {
            "kind": "agent",
            "ok": "1",
            "turn": str(turn),
            "prompt_tokens": str(prompt),
            "cached_tokens": str(cached),
            "reusable_tokens": str(reusable),
            "ttft_ms": str(ttft),
        }

    rows = [
        row(0, 1000, 0, 0, 50.0),
        row(1, 1400, 896, 896, 20.0),  # every reusable block served
        row(2, 1800, 1408, 1280, 22.0),  # more than reusable: counted as reusable
        row(3, 2200, 0, 1792, 90.0),  # evicted: nothing served
        {"kind": "background", "ok": "1", "ttft_ms": "5"},
        {"kind": "agent", "ok": "0", "turn": "1"},
    ]
    s = summarize(rows)
    assert s["turns"] == 4 and s["errors"] == 1 and s["background_requests"] == 1
    assert s["reusable_tokens"] == 896 + 1280 + 1792
    assert s["reused_share"] == (896 + 1280) / (896 + 1280 + 1792)
    assert s["ttft_ms_first"]["p50"] == 50.0
    assert s["hit_rate"] == (896 + 1408) / (1000 + 1400 + 1800 + 2200)
