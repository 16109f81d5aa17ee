"""Closing an embedded engine leaves nothing of it in the gateway's process.

An embedded replica's engine (``build_replicas``, as ``vcache serve`` composes it: the CPU
vLLM engine core in a child process, vLLM's client in this one) answers a request and is
closed, twice over (a restart builds the next from the replica's factory).  vLLM's
shutdown closes its client's sockets but leaves the client's ZMQ context, with its two
I/O threads and its reaper, to whoever drops the client last: pyzmq then destroys it
with a ResourceWarning ("Unclosed context"), at once when nothing else holds the client,
or when the garbage collector gets to it.  The engine's ``close`` terminates it: no
such warning, and the threads end with the close (the collector is off meanwhile)."""

from __future__ import annotations

import asyncio
import gc
import os
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from engines.base import GenerateRequest, SamplingOptions
from gateway.local.build import build_replicas
from tests.integration.conftest import embedded_settings

pytestmark = pytest.mark.integration


def zmq_threads() -> list[str]:
    """The names of this process's ZMQ threads (libzmq names them ``ZMQbg/...``)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            name = Path(f"/proc/self/task/{task}/comm").read_text().strip()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        if name.startswith("ZMQbg"):
            names.append(name)
    return sorted(names)


@pytest.fixture
def no_collector() -> Iterator[None]:
    gc.collect()  # what earlier tests left goes now, not in the middle of this one
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_a_closed_engine_leaves_no_zmq_threads_and_its_restart_none_either(
    data_dir: Path, no_collector: None
) -> None:
    settings = embedded_settings(data_dir)
    before = zmq_threads()

    async def main(runtime: Path) -> None:
        (replica,) = build_replicas(settings, runtime)
        assert replica.factory is not None
        for i, engine in enumerate([replica.engine, replica.factory()]):
            await engine.start()
            assert len(zmq_threads()) > len(before)  # the client's context is running
            request = GenerateRequest(
                request_id=f"close-{i}",
                prompt_token_ids=tuple(range(10, 60)),
                sampling=SamplingOptions(max_tokens=4, temperature=0.0, ignore_eos=True),
            )
            chunks = [c async for c in engine.generate(request)]
            assert sum(len(c.token_ids) for c in chunks) == 4
            await engine.close()
            assert zmq_threads() == before, f"engine {i} left its client's ZMQ threads"

    with (
        tempfile.TemporaryDirectory(prefix="vcache-") as runtime,  # the engines' sockets
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always", ResourceWarning)
        asyncio.run(main(Path(runtime)))
    unclosed = [str(w.message) for w in caught if "Unclosed context" in str(w.message)]
    assert unclosed == []
