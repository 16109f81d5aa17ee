"""The prefill of a request of the highest class present runs in one piece.

vLLM caps what a prompt computes in one step at ``long_prefill_token_threshold``
whenever more than one request is in the engine.  The cap serves the requests
*beside* the long prompt: a request arriving waits for one short step, not for
a whole prompt, and running answers keep short steps between their tokens.
Under priority scheduling that trade is wrong for a prompt whose class is above
every other request's: each piece of it is one more step, shared with the
lower classes' decodes, before its own first token, and what the cap protects
is of a lower class.  Measured under the fairness run's flood (docs/agents.md),
an agent's turn spent 70 ms more in prefill and waited a full background step
before the core even queued it.

So, with :data:`ENV` set in the engine core's environment, a step in which
exactly one request has the highest priority present, and that request is
still in its prefill, runs with no cap (the whole step's token budget,
``max_num_batched_tokens``, still bounds it).  Lower classes keep the cap, so
it can be set low to shorten the step a higher class may find running; two
requests of the top class share steps as vLLM would have them.  Lower-class
prompts in prefill at that step are, under the gateway's first-token guard,
being stopped already (gateway/local/preempt.py); new ones wait in the gateway.
The cost: a request of the top class that arrives during such a step waits
for all of it, where the cap would have made it wait for one chunk.

The patch wraps ``Scheduler.schedule`` (``AsyncScheduler`` inherits it) in the
engine core: the cap is a local of that one method, read from the scheduler's
config at its start, so the wrapper lifts it for the step and puts it back.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

# under vLLM's logger: in the engine core only vLLM's loggers have a handler
log = logging.getLogger("vllm.vcache.top_prefill")

ENV = "VCACHE_TOP_PREFILL_UNCAPPED"  # "1": the engine core applies the patch


def lone_top_prefill(scheduler: Any) -> bool:
    """One request has the highest priority among those in the scheduler (lower value
    first), and it has not computed its whole prompt yet."""
    reqs = [*scheduler.running, *scheduler.waiting, *scheduler.kv_holding_waiting]
    if len(reqs) < 2:
        return False  # vLLM lifts the cap for a lone request itself
    top = min(r.priority for r in reqs)
    firsts = [r for r in reqs if r.priority == top]
    return len(firsts) == 1 and firsts[0].num_computed_tokens < firsts[0].num_prompt_tokens


def uncapped(schedule: Callable[..., Any]) -> Callable[..., Any]:
    """``schedule`` with the cap lifted for the steps :func:`lone_top_prefill` names."""

    @functools.wraps(schedule)
    def schedule_top_whole(self: Any, *args: Any, **kwargs: Any) -> Any:
        cfg = self.scheduler_config
        cap = cfg.long_prefill_token_threshold
        if cap <= 0 or not lone_top_prefill(self):
            return schedule(self, *args, **kwargs)
        cfg.long_prefill_token_threshold = 0
        try:
            return schedule(self, *args, **kwargs)
        finally:
            cfg.long_prefill_token_threshold = cap

    schedule_top_whole.vcache_top_prefill = True  # type: ignore[attr-defined]
    return schedule_top_whole


def install() -> None:
    """Patch vLLM's scheduler in this process (once)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    if not getattr(Scheduler.schedule, "vcache_top_prefill", False):
        Scheduler.schedule = uncapped(Scheduler.schedule)  # type: ignore[method-assign]
        log.info("the lone top-priority prefill computes whole (long-prefill cap lifted)")
