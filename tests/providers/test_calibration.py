"""Calibration recovers cache rules the emulator was set to and the gateway was not told.

The emulator's rules are changed through its admin API (a minimum, TTLs and a
step that differ from the documented ones); the calibrator only sees what
each provider's usage telemetry reports.  Targets: TTL within 10 %, minimum
exact (the issue's acceptance), and the cache step exact.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gateway.core.metrics import Metrics
from gateway.providers.calibrate import Calibrator
from gateway.providers.path import ProviderPath
from manifest.calibration import CalibratedProfile
from tests.providers.conftest import MODELS, PROVIDER_KEY, Emulator, provider_settings

ROOT = Path(__file__).resolve().parents[2]
# (rules set on the emulator, what the documented profile says)
RULES: dict[str, dict[str, Any]] = {
    "openai": {"min_prefix": 1536, "granularity": 256, "ttl_s": 540},
    "deepseek": {"min_prefix": 128, "granularity": 32, "ttl_s": 1800},
    "gemini": {"min_prefix": 3000, "ttl_s": 420},
}


def _calibrate(emulator: Emulator, target: str) -> CalibratedProfile:
    """Calibrate ``target`` on the in-process emulator, its clock moved instead of slept."""
    path = ProviderPath(provider_settings(emulator), Metrics(), transport=emulator.transport)

    async def wait(seconds: float) -> None:
        emulator.admin("clock/advance", seconds=seconds)

    async def run() -> CalibratedProfile:
        try:
            return await Calibrator(path.target(target), wait).run()
        finally:
            await path.close()

    return asyncio.run(run())


@pytest.mark.parametrize("provider", list(RULES))
def test_implicit_rules_are_recovered(emulator: Emulator, provider: str) -> None:
    emulator.admin("reset")
    rules = RULES[provider]
    emulator.admin("rules", provider=provider, **rules)
    cal = _calibrate(emulator, f"{provider}/{MODELS[provider]}")
    assert cal.min_prefix_tokens == rules["min_prefix"]
    if "granularity" in rules:
        assert cal.granularity == rules["granularity"]
    assert abs(cal.ttl_s - rules["ttl_s"]) / rules["ttl_s"] < 0.10
    assert cal.ttl_long_s is None and not cal.writes_billed
    assert cal.probes < 120


@pytest.mark.processes
def test_vcache_calibrate_recovers_anthropics_rules_and_the_path_uses_them(
    emulator_server: Emulator, tmp_path: Path
) -> None:
    emulator = emulator_server  # the CLI runs as its own process
    emulator.admin("reset")
    emulator.admin("rules", provider="anthropic", min_prefix=2048, ttl_s=420, ttl_long_s=5400)
    target = f"anthropic/{MODELS['anthropic']}"
    env = {
        **os.environ,
        "VCACHE_DATA_DIR": str(tmp_path),
        "VCACHE_PROVIDERS": json.dumps(
            {"anthropic": {"base_url": emulator.base_url("anthropic"), "api_key": PROVIDER_KEY}}
        ),
    }
    cmd = [sys.executable, "-m", "gateway.cli", "calibrate", target]
    done = subprocess.run(
        [*cmd, "--emulator-clock", emulator.url],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "minimum prefix (tokens)" in done.stdout and "2048" in done.stdout
    stored = tmp_path / "calibration" / "anthropic__claude-sonnet-4-5.json"
    cal = CalibratedProfile.from_json(stored.read_text())
    assert cal.min_prefix_tokens == 2048 and cal.granularity == 1 and cal.writes_billed
    assert abs(cal.ttl_s - 420) / 420 < 0.10
    assert cal.ttl_long_s is not None and abs(cal.ttl_long_s - 5400) / 5400 < 0.10

    # the provider path plans with the fitted rules from then on
    settings = provider_settings(emulator, data_dir=tmp_path)
    t = ProviderPath(settings, Metrics()).target(target)
    assert t.profile.min_prefix_tokens == 2048
    assert t.ttl_s == cal.ttl_s and t.calibrated == cal
