"""engine.nice: the engine processes' threads take the niceness the gateway set.  (Read
from a child process's threads: the processes tier, tests/processes/test_niceness.py.)"""

from __future__ import annotations

import os

import pytest

from engines.vllm.engine_config import VllmEngineConfig, core_environment
from engines.vllm.niceness import CPU_NICE, NICE_ENV, apply_from_env, engine_nice


@pytest.mark.parametrize("raw", ["high", "-5", "20"])
def test_a_value_that_is_not_a_niceness_is_ignored(raw: str) -> None:
    assert apply_from_env({NICE_ENV: raw}) is None


def test_the_niceness_reaches_the_core_through_its_environment() -> None:
    placed = (("VLLM_CPU_OMP_THREADS_BIND", "0"),)
    niced = VllmEngineConfig(model="m", served_name="s", placement=placed, nice=10)
    own = os.getpriority(os.PRIO_PROCESS, 0)  # the engines' is above this process's
    assert core_environment(niced) == (*placed, (NICE_ENV, str(min(19, own + 10))))
    zero = VllmEngineConfig(model="m", served_name="s", placement=placed, nice=0)
    assert core_environment(zero) == placed


def test_unset_the_engines_yield_on_a_cpu_host_only() -> None:
    assert engine_nice(None, cpu=True) == CPU_NICE > 0
    assert engine_nice(None, cpu=False) == 0
    assert engine_nice(0, cpu=True) == 0
    assert engine_nice(3, cpu=False) == 3


def test_the_niceness_is_counted_from_the_gateways_own() -> None:
    assert engine_nice(5, cpu=True, own=4) == 9
    assert engine_nice(None, cpu=True, own=15) == 19  # at most 19
    assert engine_nice(None, cpu=False, own=6) == 6  # level with the gateway


def test_a_niceness_below_the_process_own_is_refused_without_a_crash(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # an engine process at 12 (its gateway run under `nice -n 12`, say) asked for 3:
    # the kernel refuses an unprivileged process a lower niceness
    def refuse(which: int, who: int, prio: int) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "getpriority", lambda which, who: 12)
    monkeypatch.setattr(os, "setpriority", refuse)
    assert apply_from_env({NICE_ENV: "3"}) is None
    assert apply_from_env({NICE_ENV: "12"}) == 12  # already so: nothing to set


def test_the_setting_is_bounded() -> None:
    from pydantic import ValidationError

    from gateway.core.engine_settings import EngineSettings

    assert EngineSettings().nice is None
    assert EngineSettings(nice=19).nice == 19
    with pytest.raises(ValidationError):
        EngineSettings(nice=20)
