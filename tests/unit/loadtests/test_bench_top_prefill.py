"""The top-prefill bench's arms name real engine settings, and its table states what
each arm adds to the arm without a background."""

from __future__ import annotations

from gateway.core.engine_settings import EngineSettings
from loadtests.bench_top_prefill import ARMS, _row, _text


def test_every_arm_sets_engine_settings_that_exist() -> None:
    fields = {name.upper() for name in EngineSettings.model_fields}
    for _busy, settings, workers in ARMS.values():
        assert set(settings) <= fields  # else the arm would run the defaults unseen
        assert workers >= 1
    assert not ARMS["alone"][0] and all(ARMS[a][0] for a in ARMS if a != "alone")


def _round(ttfts: list[float], submit_p90: float | None, bg_done: int) -> dict[str, object]:
    phases = {"submit": {"mean_ms": 1.0, "p90_ms": submit_p90, "count": len(ttfts)}}
    return {
        "ttft_ms": ttfts,
        "failed": 0,
        "seconds": 10.0,
        "bg_done": bg_done,
        "stops": 3.0,
        "phases": phases,
    }


def test_the_table_adds_to_alone() -> None:
    alone = _row("alone", [_round([100.0] * 10, 2.0, 0)])
    held = _row("held", [_round([130.0] * 10, 20.0, 40), _round([150.0] * 10, 25.0, 10)])
    assert held["ttft_ms"] == {"p50": 130.0, "p90": 150.0}
    assert held["bg_rps"] == 2.5 and held["stops"] == 6.0
    assert held["phases"]["submit"]["p90_ms"] == 25.0  # the rounds' largest
    last = _text([alone, held]).splitlines()[-1].split()
    assert last == ["held", "20", "0", "130", "150", "30", "50", "25", "2.50", "6"]
    # without an alone arm nothing is added, and the columns stay in place
    only = _text([held]).splitlines()[-1].split()
    assert only[5:7] == ["-", "-"]
