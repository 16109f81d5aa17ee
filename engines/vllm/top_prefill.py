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

Two changes to the engine core's scheduler serve such a prompt, each set by the
gateway in the core's environment:

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

They run in vLLM's own extension point: the scheduler class
(:data:`SCHEDULER_CLS`, engines/vllm/top_first_scheduler.py), which the gateway names
in the engine arguments (``scheduler_cls``; ``vllm serve --scheduler-cls``) when
*whole* or *alone* is on, and whose ``schedule`` is :func:`schedule_top_first` around
vLLM's own.  This module is the logic, without vLLM: the cap is a local of that one
method, read from the scheduler's config at its start, so :func:`schedule_top_first`
lifts it for the step and puts it back; the held requests leave ``running`` and
``waiting`` for the call and return to their places after it.  The defaults (*whole*
and *alone* on, *decodes* off) are measured in docs/notebook_agents.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

ENV = "VCACHE_TOP_PREFILL_UNCAPPED"  # "1": the lone top prefill computes whole
ALONE_ENV = "VCACHE_TOP_PREFILL_ALONE"  # "1": lower classes' prefills wait for it
DECODES_ENV = "VCACHE_TOP_PREFILL_DECODES"  # "1": ... and their decodes
STEPS = "vcache_top_prefill_steps"  # the scheduler's attribute counting what was done
# vLLM's scheduler_cls (--scheduler-cls) that applies them; it picks vLLM's
# AsyncScheduler under it when the engine schedules asynchronously
SCHEDULER_CLS = "engines.vllm.top_first_scheduler.TopFirstScheduler"

T = TypeVar("T")


@dataclass(frozen=True)
class TopFirst:
    """Which of the three are on (:data:`ENV`, :data:`ALONE_ENV`, :data:`DECODES_ENV`)."""

    whole: bool = False
    alone: bool = False
    decodes: bool = False  # with alone only

    def __bool__(self) -> bool:
        """Whether it changes any step (``decodes`` without ``alone`` changes none)."""
        return self.whole or self.alone

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> TopFirst:
        """As the gateway set them in the engine core's environment (``"1"``: on)."""
        return cls(
            whole=env.get(ENV) == "1",
            alone=env.get(ALONE_ENV) == "1",
            decodes=env.get(DECODES_ENV) == "1",
        )

    def environment(self) -> tuple[tuple[str, str], ...]:
        """The variables that say so to an engine core (those that are on)."""
        on = ((ENV, self.whole), (ALONE_ENV, self.alone), (DECODES_ENV, self.decodes))
        return tuple((name, "1") for name, yes in on if yes)


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
class Lowered:
    """Lower-class requests that compute no prompt tokens this step."""

    running: list[Any] = field(default_factory=list)
    waiting: list[Any] = field(default_factory=list)
    unfit: bool = False  # a top prompt was in prefill, but did not fit: nothing held

    def __bool__(self) -> bool:
        return bool(self.running or self.waiting)


def lower_prefills(scheduler: Any, *, decodes: bool = False) -> Lowered:
    """What waits for the top class's prefill this step: the lower classes' prompts
    (with ``decodes``, all their running requests).  Nothing, when no request of the
    top class is in prefill, when its prompts would not fit in the free blocks, or when
    admitting it could pass the running limit with the held requests back."""
    reqs = [*scheduler.running, *scheduler.waiting, *scheduler.kv_holding_waiting]
    if len(reqs) < 2 or scheduler.policy.value != "priority":
        return Lowered()
    top = min(r.priority for r in reqs)
    tops = [r for r in reqs if r.priority == top and _in_prefill(r)]
    if not tops:
        return Lowered()
    lower = [r for r in scheduler.running if r.priority > top]
    held = Lowered(
        running=lower if decodes else [r for r in lower if _in_prefill(r)],
        waiting=[r for r in scheduler.waiting if r.priority > top],
    )
    pool, bs = scheduler.kv_cache_manager.block_pool, scheduler.block_size
    if sum(_blocks_needed(r, pool, bs) for r in tops) > pool.get_num_free_blocks():
        return Lowered(unfit=True)  # vLLM preempts the lowest class to make room, as it would
    admitted = len(scheduler.waiting) - len(held.waiting) + len(scheduler.kv_holding_waiting)
    if len(scheduler.running) + admitted > scheduler.max_num_running_reqs:
        return Lowered(unfit=True)
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


def _hold(scheduler: Any, held: Lowered) -> None:
    ids = {id(r) for r in held.running}
    scheduler.running = [r for r in scheduler.running if id(r) not in ids]
    scheduler.waiting.remove_requests(held.waiting)


def _release(scheduler: Any, held: Lowered, before: list[Any]) -> None:
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


def schedule_top_first(scheduler: Any, schedule: Callable[[], T], modes: TopFirst) -> T:
    """One step of ``scheduler`` by vLLM's ``schedule``, with the cap lifted for the
    steps :func:`lone_top_prefill` names (``modes.whole``) and the lower classes'
    prefills held while the top class's runs (``modes.alone``; with ``modes.decodes``,
    their decodes as well)."""
    if not modes:
        return schedule()
    cfg = scheduler.scheduler_config
    cap = cfg.long_prefill_token_threshold
    uncap = modes.whole and cap > 0 and lone_top_prefill(scheduler)
    held = lower_prefills(scheduler, decodes=modes.decodes) if modes.alone else Lowered()
    _count(scheduler, uncap, held)
    if not uncap and not held:
        return schedule()
    before = list(scheduler.running)
    if uncap:
        cfg.long_prefill_token_threshold = 0
    _hold(scheduler, held)
    try:
        return schedule()
    finally:
        cfg.long_prefill_token_threshold = cap
        if held:
            _release(scheduler, held, before)


def _count(scheduler: Any, uncap: bool, held: Lowered) -> None:
    """Steps by what was changed (``vcache_cache_stats`` reports them): the cap
    lifted, lower requests held, a top prompt that did not fit (nothing held)."""
    steps: dict[str, int] | None = getattr(scheduler, STEPS, None)
    if steps is None:
        steps = no_steps()
        setattr(scheduler, STEPS, steps)
    steps["uncapped"] += uncap
    steps["held"] += bool(held)
    steps["unfit"] += held.unfit


def no_steps() -> dict[str, int]:
    """The step counters before the first step."""
    return {"uncapped": 0, "held": 0, "unfit": 0}
