"""vcache's scheduler: vLLM's, with the top-priority prefill first, whole and alone
(engines/vllm/top_prefill.py says what and why), holds carried in requests taken,
let go and answered (engines/vllm/core_holds.py), and a request's outputs coalesced by
its ``stream_interval`` where they are made (engines/vllm/core_coalesce.py).

vLLM builds its engine core's scheduler from ``scheduler_cls``
(``vllm/config/scheduler.py`` ``get_scheduler_cls``; ``vllm serve --scheduler-cls``).
The gateway names :class:`TopFirstScheduler` there (:data:`~engines.vllm.top_prefill.SCHEDULER_CLS`,
``engine_config.engine_args``) when ``engine.top_prefill_whole`` or
``engine.top_prefill_alone`` is on; which of the three are on it reads from the core's
environment (:class:`~engines.vllm.top_prefill.TopFirst`), as the gateway sets it.

A ``scheduler_cls`` replaces vLLM's own choice between ``Scheduler`` and
``AsyncScheduler`` (async scheduling stays as the config resolved it), so the class
keeps that choice: built where ``scheduler_config.async_scheduling`` is on, it is
:class:`TopFirstAsyncScheduler` (over vLLM's ``AsyncScheduler``, as vLLM's own
``DiffusionAsyncScheduler`` is), otherwise over ``Scheduler``.  vLLM's CPU platform
turns async scheduling off; a GPU engine has it on by default.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from engines.vllm import core_coalesce, core_holds
from engines.vllm.top_prefill import STEPS, TopFirst, no_steps, schedule_top_first

# under vLLM's logger: in the engine core only vLLM's loggers have a handler
log = logging.getLogger("vllm.vcache.top_first_scheduler")


class TopFirstScheduler(Scheduler):
    """vLLM's scheduler whose ``schedule`` serves the top-priority prefill first."""

    def __new__(cls, *args: Any, **kwargs: Any) -> TopFirstScheduler:
        """The async variant where the engine schedules asynchronously (vLLM's choice
        between its two schedulers, kept)."""
        config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
        if cls is TopFirstScheduler and config.scheduler_config.async_scheduling:
            return object.__new__(TopFirstAsyncScheduler)
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.vcache_top_first = TopFirst.from_env()
        setattr(self, STEPS, no_steps())
        m = self.vcache_top_first
        log.info(
            "%s: the top-priority prefill whole (long-prefill cap lifted) %s, alone "
            "(lower classes' prefills held) %s, their decodes held too %s",
            type(self).__name__,
            m.whole,
            m.alone,
            m.alone and m.decodes,
        )

    def add_request(self, request: Request) -> None:
        core_holds.on_add(self, request)  # before vLLM queues it
        super().add_request(request)

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        step = super().schedule
        out = schedule_top_first(self, lambda: step(throttle_prefills), self.vcache_top_first)
        core_holds.on_scheduled(self, out.num_scheduled_tokens)
        return out

    def finish_requests(
        self, request_ids: str | Iterable[str] | None, finished_status: RequestStatus
    ) -> list[Request]:
        finished = super().finish_requests(request_ids, finished_status)
        ids = [r.request_id for r in finished]
        core_coalesce.on_finished(self, ids)
        core_holds.on_finished(self, ids)
        return finished

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        core_coalesce.on_outputs(self, outputs)  # first: the answers ride on outputs sent
        core_holds.on_outputs(self, outputs)
        return outputs


class TopFirstAsyncScheduler(TopFirstScheduler, AsyncScheduler):
    """:class:`TopFirstScheduler` over vLLM's ``AsyncScheduler`` (async scheduling on)."""
