"""One engine core, several gateway processes: vLLM's multi-frontend engine-core client.

``vcache serve --workers N`` with embedded replicas runs each replica's engine
core once, in the parent of the workers, the way ``vllm serve
--api-server-count N`` does (``vllm/entrypoints/cli/serve.py``
``run_multi_api_server``): the parent binds one input (ROUTER) and one output
(PULL) listener per worker (``bind_engine_zmq_listeners``) and launches the
core on them (``launch_core_engines``); each worker adopts its pair of
listening sockets, inherited as file descriptors, and builds an ``AsyncLLM``
client on them (``client_index`` of ``client_count``).  The core schedules
every worker's requests in one batch and one prefix cache, and sends each
worker the outputs of its own requests; the workers tokenize, route, stream
and detokenize in parallel.

The core's KV events are a PUB socket and its replay a ROUTER, so every
worker subscribes to them itself, as it does a remote replica's.  Span control
(pins, evictions) goes through each worker's own client as utility calls,
answered to the worker that asked.

A client attaches once: vLLM's core announces itself to each client when it
starts, so a worker started again could not attach to a running core.  The
parent therefore restarts the whole set (cores and workers) when a core dies
or the last worker does; see ``gateway/workers.py``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from engines.vllm.engine_config import VllmEngineConfig, core_environment, engine_args
from engines.vllm.lifeline import GATEWAY_PID_ENV
from engines.vllm.placement import core_env

log = logging.getLogger(__name__)
SLOTS_ENV = "VCACHE_ENGINE_SLOTS"  # the slots of this worker, one per replica (JSON)


@dataclass(frozen=True)
class CoreSlot:
    """What one worker needs to attach to one running engine core."""

    input_address: str
    output_address: str
    input_fd: int  # the listening sockets, inherited from the parent
    output_fd: int
    client_index: int
    client_count: int
    core_pid: int  # the engine core process, to tell when it is gone

    def alive(self) -> bool:
        """The engine core process exists (a client cannot tell a core killed outright)."""
        try:
            os.kill(self.core_pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def attach(self, args: Any, stat_loggers: list[Any]) -> Any:
        """An ``AsyncLLM`` on this slot: blocks until the core has announced itself."""
        from vllm.v1.engine.async_llm import AsyncLLM

        config = _frontend_config(args, self.client_count, self.client_index)
        addresses = {
            "input_address": self.input_address,
            "output_address": self.output_address,
            "input_listener": socket.socket(fileno=self.input_fd),
            "output_listener": socket.socket(fileno=self.output_fd),
        }
        return AsyncLLM.from_vllm_config(
            config,
            stat_loggers=stat_loggers,
            client_addresses=addresses,
            client_count=self.client_count,
            client_index=self.client_index,
        )


def _frontend_config(args: Any, frontends: int, rank: int) -> Any:
    """vLLM's config for ``args`` as one of ``frontends`` API processes (``rank`` -1: the
    process that launches the core), as ``vllm serve --api-server-count`` builds it."""
    from vllm.usage.usage_lib import UsageContext

    args._api_process_count = frontends
    args._api_process_rank = rank
    return args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)


def slots_to_env(runtime_dir: str, slots: Sequence[CoreSlot]) -> str:
    return json.dumps({"runtime_dir": runtime_dir, "slots": [asdict(s) for s in slots]})


def slots_from_env(environ: Mapping[str, str]) -> tuple[str, list[CoreSlot]] | None:
    """This worker's slots, one per embedded replica, and the directory of the cores'
    sockets; None outside such a worker."""
    raw = environ.get(SLOTS_ENV)
    if raw is None:
        return None
    value = json.loads(raw)
    return str(value["runtime_dir"]), [CoreSlot(**s) for s in value["slots"]]


@dataclass
class _Core:
    manager: Any  # vLLM's CoreEngineProcManager
    listeners: Any  # vLLM's EngineZmqListeners: per worker, an input and an output


class SharedCores:
    """The parent's engine cores, one per replica, each with a slot per worker."""

    def __init__(self, configs: Sequence[VllmEngineConfig], workers: int, runtime_dir: str) -> None:
        self._configs = list(configs)
        self._workers = workers
        self.runtime_dir = runtime_dir  # where the configs' KV-event sockets are
        self._cores: list[_Core] = []

    def start(self) -> None:
        """Launch the cores one at a time (each sizes its memory on start); blocks until
        each has loaded its model."""
        from vllm.v1.engine.utils import bind_engine_zmq_listeners, launch_core_engines
        from vllm.v1.executor import Executor

        for i, c in enumerate(self._configs):
            # the core inherits the environment: the block hashes' seed, and the
            # lifeline that ties it to this process (engines/vllm/lifeline.py)
            os.environ["PYTHONHASHSEED"] = c.hash_seed
            os.environ[GATEWAY_PID_ENV] = str(os.getpid())
            config = _frontend_config(engine_args(c), self._workers, -1)
            listeners = bind_engine_zmq_listeners(config, self._workers)
            try:
                log.info("starting replica-%d's engine core for %d workers", i, self._workers)
                with (
                    core_env(core_environment(c)),
                    launch_core_engines(
                        config, Executor.get_class(config), True, listeners.addresses
                    ) as launch,
                ):
                    manager = launch.engine_manager
            except BaseException:
                listeners.cleanup()
                raise
            self._cores.append(_Core(manager, listeners))
            # vLLM's launch keeps this frame alive (a traceback it holds): let go of the
            # listeners here, or close() cannot free them before the interpreter exits
            del listeners, manager

    def slots(self, worker: int) -> list[CoreSlot]:
        """Worker ``worker``'s slot on every core."""
        return [
            CoreSlot(
                input_address=c.listeners.inputs[worker].address,
                output_address=c.listeners.outputs[worker].address,
                input_fd=c.listeners.inputs[worker].socket.fileno(),
                output_fd=c.listeners.outputs[worker].socket.fileno(),
                client_index=worker,
                client_count=self._workers,
                core_pid=int(c.manager.processes[0].pid),
            )
            for c in self._cores
        ]

    def fds(self, worker: int) -> list[int]:
        """The descriptors worker ``worker`` inherits."""
        return [fd for s in self.slots(worker) for fd in (s.input_fd, s.output_fd)]

    def dead(self) -> str | None:
        """Which core has exited, if one has (reaping it)."""
        for i, c in enumerate(self._cores):
            for p in c.manager.processes:
                if p.exitcode is not None:
                    return f"replica-{i}'s engine core exited ({p.exitcode})"
        return None

    def close(self) -> None:
        for c in self._cores:
            with contextlib.suppress(Exception):
                c.manager.shutdown()
            c.listeners.cleanup()
        self._cores = []
