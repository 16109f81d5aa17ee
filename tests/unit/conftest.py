"""The hermetic tier: no network, no stores, no subprocesses (docs/development.md).

Every test here runs under a guard: starting a process (``subprocess``, ``asyncio``'s
subprocesses, ``multiprocessing``, ``os.fork``) or connecting a socket to anything
but loopback or a Unix socket raises :class:`NotHermetic`, and the test fails at its
end even where the code under test caught and translated the error.  A test that
needs those belongs to the tier that says so: ``tests/stores`` (PostgreSQL, Redis),
``tests/processes`` (processes of its own), ``tests/network`` (the internet).
"""

from __future__ import annotations

import functools
import importlib
import ipaddress
import multiprocessing.util
import os
import platform
import socket
import subprocess
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import pytest

DEMO_ARCHITECTURE = "LlamaForCausalLM"  # engines/vllm/demo_model.py


class NotHermetic(RuntimeError):
    """A unit test reached outside the process (a subprocess, a non-loopback socket)."""


_seen: list[str] = []


def _refuse(what: str) -> NoReturn:
    _seen.append(what)
    raise NotHermetic(
        f"tests/unit is hermetic: {what}; a test that needs it belongs to "
        "tests/processes, tests/stores or tests/network (docs/development.md)"
    )


def _local(family: int, address: Any) -> bool:
    """Whether a socket address is on this machine: a Unix socket, or loopback."""
    if family not in (socket.AF_INET, socket.AF_INET6):
        return True
    host = str(address[0])
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return False  # a name: resolving it is the network
    return ip.is_loopback or ip.is_unspecified


def _guard_connect(original: Callable[..., Any]) -> Callable[..., Any]:
    def connect(self: socket.socket, address: Any) -> Any:
        if not _local(self.family, address):
            _refuse(f"a socket connected to {address!r}")
        return original(self, address)

    return connect


def _guard_process(name: str) -> Callable[..., NoReturn]:
    def start(*args: Any, **kwargs: Any) -> NoReturn:
        _refuse(f"a process started ({name})")

    return start


@functools.cache
def _vllm_model_info() -> None:
    """vLLM inspects a model architecture in a subprocess the first time a machine sees
    it (the answer is cached under ``VLLM_CACHE_ROOT``): the demo model's is inspected
    here, once, before the guard, so the tier passes on a fresh machine as on a warm one."""
    from vllm.model_executor.models.registry import ModelRegistry

    if ModelRegistry._try_inspect_model_cls(DEMO_ARCHITECTURE) is None:
        raise RuntimeError(f"vLLM cannot inspect {DEMO_ARCHITECTURE}")


@pytest.fixture(scope="module", autouse=True)
def _hermetic() -> Iterator[None]:
    # the standard library asks ``uname -p`` once per process, the first time anything
    # (vLLM's platform detection) reads the processor; cpuinfo, imported by vLLM, asks
    # ``file`` for the interpreter's architecture once, at its import: both happen here,
    # before the guard, so a file run alone passes as in the whole tier
    platform.uname().processor  # noqa: B018
    importlib.import_module("cpuinfo")
    _vllm_model_info()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(socket.socket, "connect", _guard_connect(socket.socket.connect))
        mp.setattr(socket.socket, "connect_ex", _guard_connect(socket.socket.connect_ex))
        mp.setattr(subprocess.Popen, "_execute_child", _guard_process("subprocess.Popen"))
        mp.setattr(os, "fork", _guard_process("os.fork"))
        mp.setattr(os, "posix_spawn", _guard_process("os.posix_spawn"))
        mp.setattr(os, "posix_spawnp", _guard_process("os.posix_spawnp"))
        mp.setattr(multiprocessing.util, "spawnv_passfds", _guard_process("multiprocessing"))
        yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    _seen.clear()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """Fail the test that reached outside, even where its code swallowed the error."""
    result = yield
    if _seen:
        reached, _seen[:] = list(_seen), []
        pytest.fail("; ".join(dict.fromkeys(reached)), pytrace=False)
    return result
