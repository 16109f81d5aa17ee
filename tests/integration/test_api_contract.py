"""Contract fuzzing in CI: ``python -m scripts.fuzz_api`` with a small budget (schemathesis against
a gateway of its own, keys on, the real engine and the provider emulator behind it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def test_schemathesis_finds_no_server_error_and_no_schema_violation(
    data_dir: Path, demo_model: Path, tmp_path: Path
) -> None:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "scripts.fuzz_api",
            "--max-examples",
            "5",
            "--max-time",
            "90",
            "--seed",
            "3",
            "--data-dir",
            str(data_dir),
            "--out",
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    statuses: dict[str, int] = summary["statuses"]
    assert summary["alive"] is True
    assert sum(statuses.values()) > 500  # it really exercised the API
    assert statuses.get("200", 0) > 0 and statuses.get("400", 0) > 0
    assert [s for s in statuses if s.startswith("5")] == []
    gating = {
        "not_a_server_error",
        "status_code_conformance",
        "content_type_conformance",
        "response_schema_conformance",
    }
    assert gating.isdisjoint(summary["failures"])
