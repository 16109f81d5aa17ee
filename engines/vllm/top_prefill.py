"""The prefill of a request of the highest class present: whole, and alone.

vLLM caps what a prompt computes in one step at ``long_prefill_token_threshold``
whenever more than one request is in the engine.  The cap serves the requests
*beside* the long prompt: a request arriving waits for one short step, not for
a whole prompt, and running answers keep short steps between their tokens.
Under priority scheduling that trade is wrong for a prompt whose class is above
every other request's: each piece of it is one more step, shared with the
lower classes' decodes, before its own first token, and what the cap protects
is of a lower class.  Measured under the fairness run's flood (docs/notebook_agents.md),
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
  would not fit in the free KV blocks, nothing is held (nor is the cap lifted), so
  vLLM's own preemption (lowest priority first) runs as it would.  What a prompt
  needs is its blocks not in the prefix cache already: under KV pressure an
  agent's turn, its conversation leased, needs its new tail, not its whole
  context (counted whole, the hold never engaged for such turns when the cache
  was small).  The cost, by design: a lower class's
  prefill starves while higher-class prompts keep arriving.
* :data:`DECODES_ENV` (with *alone*): the lower classes' decodes skip those steps
  too, so the top prefill's steps compute nothing else: each held answer pauses
  for the length of that prefill (its blocks kept), then goes on.

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
DECODES_ENV = "VCACHE_TOP_PREFILL_DECODES"  # "1": ... and their decodes
STEPS = "vcache_top_prefill_steps"  # the scheduler's attribute counting what was done


def _in_prefill(r: Any) -> bool:
    return bool(r.num_computed_tokens < r.num_prompt_tokens)


def lone_top_prefill(scheduler: Any) -> bool:
    """One request has the highest priority among those in the scheduler (lower value
    first), it has not computed its whole prompt yet, and what is left of it fits in the
    free blocks (a step uncapped for a prompt that cannot be scheduled would go whole to
    the lower classes' prompts)."""
    reqs = [*scheduler.running, *scheduler.waiting, *scheduler.kv_holding_waiting]
    if len(reqs) < 2:
        return False  # vLLM lifts the cap for a lone request itself
    top = min(r.priority for r in reqs)
    firsts = [r for r in reqs if r.priority == top]
    if len(firsts) != 1 or not _in_prefill(firsts[0]):
        return False
    pool = scheduler.kv_cache_manager.block_pool
    free: int = pool.get_num_free_blocks()
    return _blocks_needed(firsts[0], pool, scheduler.block_size) <= free


@dataclass
class Held:
    """Lower-class requests that compute no prompt tokens this step."""

    running: list[Any] = field(default_factory=list)
    waiting: list[Any] = field(default_factory=list)
    unfit: bool = False  # a top prompt was in prefill, but did not fit: nothing held

    def __bool__(self) -> bool:
        return bool(self.running or self.waiting)


def lower_prefills(scheduler: Any, *, decodes: bool = False) -> Held:
    """What waits for the top class's prefill this step: the lower classes' prompts
    (with ``decodes``, all their running requests).  Nothing, when no request of the
    top class is in prefill, when its prompts would not fit in the free blocks, or when
    admitting it could pass the running limit with the held requests back."""
    reqs = [*scheduler.running, *scheduler.waiting, *scheduler.kv_holding_waiting]
    if len(reqs) < 2 or scheduler.policy.value != "priority":
        return Held()
    top = min(r.priority for r in reqs)
    tops = [r for r in reqs if r.priority == top and _in_prefill(r)]
    if not tops:
        return Held()
    lower = [r for r in scheduler.running if r.priority > top]
    held = Held(
        running=lower if decodes else [r for r in lower if _in_prefill(r)],
        waiting=[r for r in scheduler.waiting if r.priority > top],
    )
    pool, bs = scheduler.kv_cache_manager.block_pool, scheduler.block_size
    if sum(_blocks_needed(r, pool, bs) for r in tops) > pool.get_num_free_blocks():
        return Held(unfit=True)  # vLLM preempts the lowest class to make room, as it would
    admitted = len(scheduler.waiting) - len(held.waiting) + len(scheduler.kv_holding_waiting)
    if len(scheduler.running) + admitted > scheduler.max_num_running_reqs:
        return Held(unfit=True)
    return held


def _blocks_needed(r: Any, pool: Any, block_size: int) -> int:
    """The free blocks ``r``'s prompt will take: one per block it has not computed,
    less, for a prompt not scheduled yet, the leading blocks of it that the prefix cache
    holds for another request or a pin (a cached block nobody holds is in the free pool:
    it counts).  A session's turn whose conversation is leased needs its new tail only."""
    need: int = -(-(r.num_tokens - r.num_computed_tokens) // block_size)
    if r.num_computed_tokens:
        return need
    for h in r.block_hashes[: (r.num_tokens - 1) // block_size]:  # vLLM recomputes the last
        blocks = pool.get_cached_block(h, [0])  # one KV-cache group (plugin._GROUP)
        if not blocks:
            break
        need -= blocks[0].ref_cnt > 0
    return need


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


def top_first(
    schedule: Callable[..., Any], *, whole: bool, alone: bool, decodes: bool = False
) -> Callable[..., Any]:
    """``schedule`` with the cap lifted for the steps :func:`lone_top_prefill` names
    (``whole``) and the lower classes' prefills held while the top class's runs
    (``alone``; with ``decodes``, their decodes as well)."""

    @functools.wraps(schedule)
    def schedule_top_first(self: Any, *args: Any, **kwargs: Any) -> Any:
        cfg = self.scheduler_config
        cap = cfg.long_prefill_token_threshold
        uncap = whole and cap > 0 and lone_top_prefill(self)
        held = lower_prefills(self, decodes=decodes) if alone else Held()
        _count(self, uncap, held)
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


def _count(scheduler: Any, uncap: bool, held: Held) -> None:
    """Steps by what the patch did (``vcache_cache_stats`` reports them): the cap
    lifted, lower requests held, a top prompt that did not fit (nothing held)."""
    steps: dict[str, int] | None = getattr(scheduler, STEPS, None)
    if steps is None:
        steps = {"uncapped": 0, "held": 0, "unfit": 0}
        setattr(scheduler, STEPS, steps)
    steps["uncapped"] += uncap
    steps["held"] += bool(held)
    steps["unfit"] += held.unfit


def install(*, whole: bool, alone: bool, decodes: bool = False) -> None:
    """Patch vLLM's scheduler in this process (once)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    if getattr(Scheduler.schedule, "vcache_top_prefill", False) or not (whole or alone):
        return
    Scheduler.schedule = top_first(  # type: ignore[method-assign]
        Scheduler.schedule, whole=whole, alone=alone, decodes=decodes
    )
    log.info(
        "the top-priority prefill: whole (long-prefill cap lifted) %s, alone (lower "
        "classes' prefills held) %s, their decodes held too %s",
        whole,
        alone,
        alone and decodes,
    )
