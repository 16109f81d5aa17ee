"""vLLM's scheduler with the top-priority prefill first: whole, and alone
(engines/vllm/top_prefill.py says what and why).

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
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler

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

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        step = super().schedule
        return schedule_top_first(self, lambda: step(throttle_prefills), self.vcache_top_first)


class TopFirstAsyncScheduler(TopFirstScheduler, AsyncScheduler):
    """:class:`TopFirstScheduler` over vLLM's ``AsyncScheduler`` (async scheduling on)."""
