"""engine.nice, read from a process of its own: every thread of an engine process
(one started before the niceness is applied, one after) takes the niceness the gateway
set, as the kernel reports it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engines.vllm.niceness import NICE_ENV

pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parents[2]

# A process with a thread already running (as an engine core has its ZMQ and
# OpenMP threads) applies the niceness, then starts another thread; it prints
# every thread's niceness as the kernel reports it.
CHILD = """
import os, threading
from engines.vllm.niceness import apply_from_env

stop = threading.Event()
early = threading.Thread(target=stop.wait, daemon=True)
early.start()
print("applied", apply_from_env())
late = threading.Thread(target=stop.wait, daemon=True)
late.start()  # running once start() returns: listed under /proc/self/task
for tid in sorted(os.listdir("/proc/self/task")):
    fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
    print("thread", tid, fields[16])  # the 19th field of stat: nice
stop.set()
"""


def _child(env: dict[str, str]) -> list[str]:
    full = {**os.environ, **env, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-c", CHILD],
        env=full,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return run.stdout.split("\n")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_every_thread_of_the_engine_process_takes_the_niceness() -> None:
    out = _child({NICE_ENV: "7"})
    assert out[0] == "applied 7"
    nices = [line.split()[2] for line in out if line.startswith("thread")]
    assert len(nices) == 3  # the main thread, one started before, one after
    assert set(nices) == {"7"}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_process_without_the_variable_keeps_its_niceness() -> None:
    env = {k: v for k, v in os.environ.items() if k != NICE_ENV}
    out = _child({**env})
    assert out[0] == "applied None"
    here = str(os.getpriority(os.PRIO_PROCESS, 0))
    assert {line.split()[2] for line in out if line.startswith("thread")} == {here}
