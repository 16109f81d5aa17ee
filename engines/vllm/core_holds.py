"""Request holds in the engine core: a routed request's leading resident blocks, kept
from eviction from its routing until vLLM schedules it (gateway/local/kv_holds.py says
why).

A hold reaches the core one of two ways:

a core call
    ``vcache_hold`` / ``vcache_release`` (engines/vllm/plugin.py): routing awaits the
    answer, the gateway lets the hold go at the request's first token.
carried in its request
    ``SamplingParams.extra_args[HOLD_ARG] = [hashes, max_share, reserve, ttl_s]``: the
    scheduler takes it as it adds the request, before the request is queued (the same
    moment as a core call sent right before it, without the call, its reply, or a
    release); it lets it go itself once the request is scheduled (the request's own
    references keep the blocks from then on) or finished before that (aborted while
    waiting).  The answer, ``[blocks held, why none were]``, rides on the request's
    first outputs as ``EngineCoreOutput.kv_transfer_params[HOLD_ARG]``: on the first
    :data:`ANSWERED_OUTPUTS` of them, since vLLM's output collector keeps only the
    newest ``kv_transfer_params`` when it merges outputs a slow reader had not taken.

Either way a hold is all or nothing, bounded by a share of the KV blocks, by the free
blocks a live request needs (``reserve``), and in time (``ttl_s``): one nobody lets go
runs out.  Carried holds need vcache's scheduler class (vLLM's ``scheduler_cls``,
engines/vllm/top_first_scheduler.py), whose ``add_request``, ``schedule``,
``finish_requests`` and ``update_from_output`` call the ``on_*`` hooks below; under
vLLM's own scheduler a request's hold is a core call.  The state lives on the
scheduler; everything runs on the engine core's thread, between or inside its steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

HOLD_ARG = "vcache_hold"  # the request's extra_args key; its outputs' kv_transfer_params key
ANSWERED_OUTPUTS = 4  # a request's first outputs that carry its hold's answer
GROUP = 0  # single KV-cache-group models (all the gateway serves today)


def block_pool(sched: Any) -> Any:
    """The scheduler's KV block pool (the prefix cache's blocks)."""
    return sched.kv_cache_manager.coordinator.block_pool


def scheduler_state(sched: Any, name: str, make: Callable[[], Any]) -> Any:
    """The scheduler's attribute ``name``, made by ``make`` the first time it is read
    (state of vcache's hooks kept on vLLM's scheduler: here and engines/vllm/core_coalesce.py)."""
    value = getattr(sched, name, None)
    if value is None:
        value = make()
        setattr(sched, name, value)
    return value


def _by_id(sched: Any) -> dict[str, tuple[list[bytes], float]]:
    """Per hold: its blocks' hashes and when it runs out (monotonic clock)."""
    return scheduler_state(sched, "_vcache_req_holds", dict)  # type: ignore[no-any-return]


def _held(sched: Any) -> dict[bytes, list[Any]]:
    """Per held block: ``[block, holds]`` (one pool reference, however many holds)."""
    return scheduler_state(sched, "_vcache_held", dict)  # type: ignore[no-any-return]


def _carried(sched: Any) -> set[str]:
    """The holds carried in requests (their ids are the requests'), not let go yet."""
    return scheduler_state(sched, "_vcache_carried", set)  # type: ignore[no-any-return]


def _answers(sched: Any) -> dict[str, list[Any]]:
    """Per request: ``[answer, outputs left to carry it]``."""
    return scheduler_state(sched, "_vcache_answers", dict)  # type: ignore[no-any-return]


def lookup(pool: Any, h: bytes) -> Any:
    """The resident block of hash ``h`` in ``pool`` (None: not cached)."""
    from vllm.v1.core.kv_cache_utils import BlockHash

    blocks = pool.get_cached_block(BlockHash(h), [GROUP])
    return blocks[0] if blocks else None


def counts(sched: Any) -> tuple[int, int]:
    """(blocks held, holds)."""
    return len(_held(sched)), len(_by_id(sched))


def let_go(sched: Any, hold_ids: Iterable[str]) -> int:
    """Drop these holds; a block no hold keeps loses the reference.  Blocks freed."""
    by, held, carried = _by_id(sched), _held(sched), _carried(sched)
    freed = []
    for hid in hold_ids:
        carried.discard(hid)
        hashes, _ = by.pop(hid, ([], 0.0))
        for h in hashes:
            entry = held.get(h)
            if entry is None:
                continue
            entry[1] -= 1
            if entry[1] <= 0:
                del held[h]
                freed.append(entry[0])
    if freed:
        block_pool(sched).free_blocks(freed[::-1])  # a prefix's tail evicted first
    return len(freed)


def expire(sched: Any, now: float) -> int:
    """Let go of the holds past their bound; blocks freed."""
    return let_go(sched, [hid for hid, (_, until) in _by_id(sched).items() if until <= now])


def take(
    sched: Any, hold_id: str, hashes: list[bytes], max_share: float, reserve: int, ttl_s: float
) -> dict[str, Any]:
    """Hold the leading resident blocks of ``hashes`` for ``hold_id`` (all or nothing):
    ``{"held": blocks, "refused": "" | "budget" | "reserve" | "duplicate"}``."""
    now = time.monotonic()
    expire(sched, now)
    pool, held, by = block_pool(sched), _held(sched), _by_id(sched)
    prefix: list[tuple[bytes, Any]] = []
    for h in hashes:
        block = held[h][0] if h in held else lookup(pool, h)
        if block is None:
            break
        prefix.append((h, block))
    if not prefix or hold_id in by:
        return {"held": 0, "refused": "" if not prefix else "duplicate"}
    new = [(h, b) for h, b in prefix if h not in held]
    taken_free = sum(1 for _, b in new if b.ref_cnt == 0)  # out of the free queue
    if len(held) + len(new) > int(pool.num_gpu_blocks * max_share):
        return {"held": 0, "refused": "budget"}
    if pool.get_num_free_blocks() - taken_free < reserve:
        return {"held": 0, "refused": "reserve"}
    pool.touch([b for _, b in new])
    for h, b in new:
        held[h] = [b, 0]
    for h, _ in prefix:
        held[h][1] += 1
    by[hold_id] = ([h for h, _ in prefix], now + ttl_s)
    return {"held": len(prefix), "refused": ""}


# ------------------------------------------------------------ carried in requests


def _asked(request: Any) -> Any:
    params = getattr(request, "sampling_params", None)
    extra = getattr(params, "extra_args", None)
    return extra.get(HOLD_ARG) if extra else None


def on_add(sched: Any, request: Any) -> None:
    """Take the hold ``request`` carries, if any, before vLLM queues it."""
    ask = _asked(request)
    rid = request.request_id
    if ask is None or rid in sched.requests:  # a streamed input's next chunk: held once
        return
    try:
        hashes, max_share, reserve, ttl_s = ask
        res = take(sched, rid, [bytes(h) for h in hashes], max_share, reserve, ttl_s)
    except (TypeError, ValueError):
        res = {"held": 0, "refused": "failed"}  # a malformed ask holds nothing
    if res["held"]:
        _carried(sched).add(rid)
    _answers(sched)[rid] = [[res["held"], res["refused"]], ANSWERED_OUTPUTS]


def on_scheduled(sched: Any, scheduled: Iterable[str]) -> None:
    """Let go of the carried holds whose requests were scheduled in this step (they
    reference their blocks themselves now) or are gone."""
    carried = _carried(sched)
    if not carried:
        return
    ids = set(scheduled)
    let_go(sched, [rid for rid in carried if rid in ids or rid not in sched.requests])


def on_finished(sched: Any, request_ids: Iterable[str]) -> None:
    """Requests finished outside a step (aborted): their carried holds go, unanswered."""
    carried, answers = _carried(sched), _answers(sched)
    gone = [rid for rid in request_ids if rid in carried or rid in answers]
    for rid in gone:
        answers.pop(rid, None)
    let_go(sched, [rid for rid in gone if rid in carried])


def on_outputs(sched: Any, outputs: dict[int, Any]) -> None:
    """Put each pending answer on its request's outputs of this step."""
    answers = _answers(sched)
    if not answers:
        return
    for batch in outputs.values():
        for out in batch.outputs:
            entry = answers.get(out.request_id)
            if entry is None:
                continue
            out.kv_transfer_params = {**(out.kv_transfer_params or {}), HOLD_ARG: entry[0]}
            entry[1] -= 1
            if entry[1] <= 0:
                del answers[out.request_id]
    for rid in [r for r in answers if r not in sched.requests]:
        del answers[rid]
