"""The prefill of a request of the highest class present: whole, and alone.

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

Two patches of the engine core's scheduler serve such a prompt, each set by
the gateway in the core's environment:

* :data:`ENV` (*whole*): a step in which exactly one request has the highest
  priority present, and that request is still in its prefill, runs with no cap
  (the step's token budget, ``max_num_batched_tokens``, still bounds it).  Two
  requests of the top class share steps as vLLM would have them.  The cost: a
  request of the top class that arrives during such a step waits for all of it.
* :data:`ALONE_ENV` (*alone*): while a request of the highest class present is in
  its prefill, the prompts of lower classes compute nothing: the running ones
  skip the step (they keep their blocks and go on after), the waiting ones stay
  queued.  Their decodes go on, one token each.  vLLM schedules running requests
  before waiting ones whatever their priority, so without this a batch prompt
  already in prefill takes its chunk of every step of an interactive prompt that
  arrives after it, and a batch prompt admitted beside it takes what the
  interactive prompt leaves of the budget.  The gateway's prefill stops
  (gateway/local/preempt.py) do the same from outside by aborting; this holds at
  the step boundary, with nothing recomputed.  Where the top class's prompts
  would not fit in the free KV blocks, nothing is held, so vLLM's own preemption
  (lowest priority first) runs as it would.  The cost, by design: a lower class's
  prefill starves while higher-class prompts keep arriving.

The patch wraps ``Scheduler.schedule`` (``AsyncScheduler`` inherits it) in the
engine core: the cap is a local of that one method, read from the scheduler's
config at its start, so the wrapper lifts it for the step and puts it back; the
held requests leave ``running`` and ``waiting`` for the call and return to their
places after it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# under vLLM's logger: in the engine core only vLLM's loggers have a handler
log = logging.getLogger("vllm.vcache.top_prefill")

ENV = "VCACHE_TOP_PREFILL_UNCAPPED"  # "1": the lone top prefill computes whole
ALONE_ENV = "VCACHE_TOP_PREFILL_ALONE"  # "1": lower classes' prefills wait for it


def _in_prefill(r: Any) -> bool:
    return bool(r.num_computed_tokens < r.num_prompt_tokens)


def lone_top_prefill(scheduler: Any) -> bool:
    """One request has the highest priority among those in the scheduler (lower value
    first), and it has not computed its whole prompt yet."""
    reqs = [*scheduler.running, *scheduler.waiting, *scheduler.kv_holding_waiting]
    if len(reqs) < 2:
        return False  # vLLM lifts the cap for a lone request itself
    top = min(r.priority for r in reqs)
    firsts = [r for r in reqs if r.priority == top]
    return len(firsts) == 1 and _in_prefill(firsts[0])


@dataclass
class Held:
    """Lower-class requests that compute no prompt tokens this step."""

    running: list[Any] = field(default_factory=list)
    waiting: list[Any] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.running or self.waiting)


def lower_prefills(scheduler: Any) -> Held:
    """What waits for the top class's prefill this step (nothing, when no request of
    the top class is in prefill, when its prompts would not fit in the free blocks, or
    when admitting it could pass the running limit with the held requests back)."""
    reqs = [*scheduler.running, *scheduler.waiting, *scheduler.kv_holding_waiting]
    if len(reqs) < 2 or scheduler.policy.value != "priority":
        return Held()
    top = min(r.priority for r in reqs)
    tops = [r for r in reqs if r.priority == top and _in_prefill(r)]
    if not tops:
        return Held()
    held = Held(
        running=[r for r in scheduler.running if r.priority > top and _in_prefill(r)],
        waiting=[r for r in scheduler.waiting if r.priority > top],
    )
    bs = scheduler.block_size
    need = sum(-(-(r.num_tokens - r.num_computed_tokens) // bs) for r in tops)
    if need > scheduler.kv_cache_manager.block_pool.get_num_free_blocks():
        return Held()  # vLLM preempts the lowest class to make room, as it would
    admitted = len(scheduler.waiting) - len(held.waiting) + len(scheduler.kv_holding_waiting)
    if len(scheduler.running) + admitted > scheduler.max_num_running_reqs:
        return Held()
    return held


def _hold(scheduler: Any, held: Held) -> None:
    ids = {id(r) for r in held.running}
    scheduler.running = [r for r in scheduler.running if id(r) not in ids]
    scheduler.waiting.remove_requests(held.waiting)


def _release(scheduler: Any, held: Held, before: list[Any]) -> None:
    """The held requests back in their places: ``running`` in its order before the
    step (less what the step preempted or finished, then what it admitted)."""
    now = {id(r) for r in scheduler.running}
    kept = now | {id(r) for r in held.running}
    was = {id(r) for r in before}
    scheduler.running = [r for r in before if id(r) in kept] + [
        r for r in scheduler.running if id(r) not in was
    ]
    for r in held.waiting:  # a priority queue: (priority, arrival) puts each back
        scheduler.waiting.add_request(r)


def top_first(schedule: Callable[..., Any], *, whole: bool, alone: bool) -> Callable[..., Any]:
    """``schedule`` with the cap lifted for the steps :func:`lone_top_prefill` names
    (``whole``) and the lower classes' prefills held while the top class's runs
    (``alone``)."""

    @functools.wraps(schedule)
    def schedule_top_first(self: Any, *args: Any, **kwargs: Any) -> Any:
        cfg = self.scheduler_config
        cap = cfg.long_prefill_token_threshold
        uncap = whole and cap > 0 and lone_top_prefill(self)
        held = lower_prefills(self) if alone else Held()
        if not uncap and not held:
            return schedule(self, *args, **kwargs)
        before = list(self.running)
        if uncap:
            cfg.long_prefill_token_threshold = 0
        _hold(self, held)
        try:
            return schedule(self, *args, **kwargs)
        finally:
            cfg.long_prefill_token_threshold = cap
            if held:
                _release(self, held, before)

    schedule_top_first.vcache_top_prefill = True  # type: ignore[attr-defined]
    return schedule_top_first


def install(*, whole: bool, alone: bool) -> None:
    """Patch vLLM's scheduler in this process (once)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    if getattr(Scheduler.schedule, "vcache_top_prefill", False) or not (whole or alone):
        return
    Scheduler.schedule = top_first(Scheduler.schedule, whole=whole, alone=alone)  # type: ignore[method-assign]
    log.info(
        "the top-priority prefill: whole (long-prefill cap lifted) %s, alone (lower "
        "classes' prefills held) %s",
        whole,
        alone,
    )
