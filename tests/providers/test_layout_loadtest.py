"""The load test's layout comparison: the provider path through the emulator, canonical
layout on and off, with a timestamp line in every system prompt."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.processes  # the load test runs as its own process


def test_layout_comparison_shows_what_the_canonical_layout_buys(tmp_path: Path) -> None:
    out = tmp_path / "report"
    cmd = [
        sys.executable,
        "-m",
        "loadtests.run",
        "--small",
        "--workloads",
        "",
        "--compare-layout",
        "--users",
        "2",
        "--duration",
        "60",
        "--out",
        str(out),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    print("\n" + done.stdout)
    layout = json.loads((out / "layout.json").read_text())
    assert set(layout["arms"]) == {
        "anthropic-canonical",
        "anthropic-passthrough",
        "openai-canonical",
        "openai-passthrough",
    }
    for arm, s in layout["arms"].items():
        assert s["requests"] == 8 and s["errors"] == 0, arm
        rows = (out / f"shared_prefix-{arm}" / "raw.csv").read_text().splitlines()[1:]
        assert {r.split(",")[9] for r in rows} == {
            arm.split("-")[0]
            + "/"
            + ("claude-sonnet-4-5" if arm.startswith("anthropic") else "gpt-5")
        }
    for model, r in layout["ratios"].items():
        assert r["hit_rate_passthrough"] == 0.0, model  # the timestamp changes every request
        assert r["hit_rate_canonical"] > 0.5, model  # the stable anchor hits
