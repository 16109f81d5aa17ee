"""The fairness runs' arithmetic: the order the runs take turns in, an arm's rounds
pooled into one percentile, and the 20% verdict judged on the pooled turns."""

from __future__ import annotations

import csv
from pathlib import Path

from loadtests.agent_fairness import base, fairness_table, order, pooled, prefill_fit, theil_sen

FIELDS = ["kind", "ok", "turn", "prompt_tokens", "cached_tokens", "ttft_ms", "t"]


def _run(out: Path, name: str, ttfts: list[float], tokens: int = 300) -> None:
    """A run's raw.csv: a turn 0 (not counted), then later turns with these TTFTs."""
    (out / name).mkdir(parents=True)
    with (out / name / "raw.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerow(
            {
                "kind": "agent",
                "ok": "1",
                "turn": "0",
                "prompt_tokens": "5000",
                "cached_tokens": "0",
                "ttft_ms": "900",
                "t": "0.5",
            }
        )
        for i, ms in enumerate(ttfts):
            w.writerow(
                {
                    "kind": "agent",
                    "ok": "1",
                    "turn": str(i + 1),
                    "prompt_tokens": str(tokens + 10 * i),
                    "cached_tokens": "0",
                    "ttft_ms": str(ms),
                    "t": str(1.0 + i),
                }
            )
        w.writerow(
            {
                "kind": "background",
                "ok": "1",
                "turn": "0",
                "prompt_tokens": "400",
                "cached_tokens": "0",
                "ttft_ms": "50",
                "t": "2",
            }
        )


def test_runs_take_turns_alone_first_and_reversed_each_round() -> None:
    assert order(1, False, None) == ["alone", "flooded_guard"]
    assert order(2, True, "decodes") == [
        "alone.1",
        "flooded_guard.1",
        "flooded_batch.1",
        "flooded_decodes.1",
        "flooded_decodes.2",
        "flooded_batch.2",
        "flooded_guard.2",
        "alone.2",
    ]
    assert base("flooded_batch.2") == "flooded_batch" and base("alone") == "alone"


def test_rounds_pool_into_one_percentile(tmp_path: Path) -> None:
    _run(tmp_path, "alone.1", [100.0] * 9 + [400.0])
    _run(tmp_path, "alone.2", [100.0] * 10)
    rows = [{"arm": "alone.1"}, {"arm": "alone.2"}]
    got = pooled(tmp_path, rows)["alone"]
    # 20 later turns, one slow: the pooled p90 is not the first round's alone
    assert got["rounds"] == 2 and got["turns"] == 20
    assert got["p90"] == 100.0
    assert prefill_fit(tmp_path, ["alone.1"]) is not None


def test_one_slow_turn_does_not_tilt_the_fit() -> None:
    xs = list(range(100, 500, 10))  # 40 turns: 20 ms of wait, 0.1 ms a token
    ys = [20.0 + 0.1 * x for x in xs]
    ys[0] = 900.0  # the shortest prompt waited behind a preemption
    fit = theil_sen(xs, ys)
    assert fit is not None
    assert abs(fit["ms_per_token"] - 0.1) < 1e-9 and abs(fit["wait_ms"] - 20.0) < 1e-9
    assert theil_sen([300, 300], [10.0, 20.0]) is None  # no two prompts differ


def _row(name: str, p90: float) -> dict[str, object]:
    return {
        "arm": name,
        "agents_rps": 1.0,
        "background_rps": 0.0,
        "errors": 0,
        "ttft_ms_later": {"p50": p90, "p90": p90},
        "ttft_ms_first": {"p90": None},
        "reused_share": None,
    }


def test_the_verdict_is_the_pooled_ratio() -> None:
    steps = {"uncapped": 40, "held": 12, "unfit": 3}  # read off the engines' stats
    loop = {"stalls": 2.0, "gc_ms": 41.6, "gc2_ms": 30.2}  # the gateway's event loop in the run
    rows = [
        _row("alone.1", 100),
        {**_row("flooded_guard.1", 130), "engine_steps": steps, "loop": loop},
    ]

    def pool(guard: float) -> dict[str, dict[str, object]]:
        one = {"rounds": 1, "turns": 10, "fit": {"ms_per_token": 0.1, "wait_ms": 5.0}}
        return {
            "alone": {**one, "p50": 80.0, "p90": 100.0},
            "flooded_guard": {**one, "p50": 90.0, "p90": guard},
        }

    text, ok = fairness_table(rows, pool(119.0), 256)
    assert ok and "ok (1.19x)" in text
    text, ok = fairness_table(rows, pool(121.0), 256)
    assert not ok and "MISSED (1.21x)" in text
    # 21 ms over alone's p90 at 0.1 ms a token: 0.82 of a 256-token step
    assert "flooded_guard adds 21 ms to the later turns' TTFT p90 = 0.82 steps" in text
    alone, guard = text.splitlines()[1:3]
    # held and unfit steps, stalls, gc ms and its oldest generation's; before they were
    # counted: -
    assert alone.split()[-5:] == ["-"] * 5
    assert guard.split()[-5:] == ["12", "3", "2", "42", "30"]
