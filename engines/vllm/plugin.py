"""vLLM general plugin: pin, unpin, evict and inspect prefix-cache blocks by hash.

Registered through the ``vllm.general_plugins`` entry point (see
pyproject.toml); vLLM loads it in every process, and in the engine-core
process it adds these utility methods to ``EngineCore``, which an engine
client reaches with ``call_utility_async("vcache_pin", ...)``:

``vcache_pin(hashes, max_share, holder, ttl_s)``
    Take one reference on each resident block (once per hash: idempotent), so
    LRU eviction cannot reuse it, held by ``holder`` (a gateway) for ``ttl_s``
    (renewed by pinning again).  Refuses to pin beyond ``max_share`` of the
    KV blocks.  Returns the hashes pinned by this call and those already pinned.
``vcache_unpin(hashes, holder)``
    Drop ``holder``'s hold; a block nobody holds loses the plugin's reference
    and becomes evictable again (most recently used end of the free queue).
``vcache_sweep()``
    Release the blocks whose holds have all run out (a gateway died holding
    them); every pin and unpin sweeps first.
``vcache_evict(hashes)``
    Remove blocks from the prefix cache if no running request and no pin holds
    them; ``BlockRemoved`` events are published at once.
``vcache_touch(hashes)``
    Move resident blocks no request or pin holds to the most recently used end of
    the free queue (a request routed to them reads them soon): evicted last.
``vcache_hold(hold_id, hashes, max_share, reserve, ttl_s)``
    Hold a request's leading resident blocks (one reference each, shared by the
    holds on a block) from its routing until it is scheduled: vLLM cannot evict
    them in that window.  All or nothing: refused when the holds would pass
    ``max_share`` of the KV blocks, or leave fewer than ``reserve`` free blocks
    (a live request's room).  Returns how many leading blocks are held (the
    request's cached prefix as the engine has it now).  A hold runs out after
    ``ttl_s`` (the bound); every hold, release and sweep lets expired holds go.
``vcache_release(hold_ids)``
    Let holds go (the request's first token, or its end); unknown ids are ignored.
    A hold can also ride in its request instead, taken, answered and let go by the
    scheduler itself (engines/vllm/core_holds.py, under the scheduler class the gateway
    names: engines/vllm/top_first_scheduler.py).
``vcache_cache_stats()`` / ``vcache_resident()``
    Counts, and every resident block hash (for a full index resync).
``vcache_events_barrier()``
    The sequence number of the last KV event batch sent, once the publisher's
    queue is empty: a subscriber that has seen it is up to date.

Hashes travel as 32-byte ``bytes``.  All of this runs on the engine core's
own thread between scheduler steps, so it never races a step.

The scheduler is not changed here: the top-priority prefill first is vLLM's
``scheduler_cls`` (engines/vllm/top_first_scheduler.py), which the gateway names in
the engine arguments; ``vcache_cache_stats`` reports its step counters.

Events before answers
    vLLM's ZMQ publisher hands each step's KV event batch to a sender thread,
    and the step's outputs to another: under CPU contention the answer could
    reach the client (who sends the next turn at once) before the batch that
    stored its blocks reached the gateway, and the gateway predicted one block
    short.  The plugin makes ``publish`` return only once the batch has been
    handed to ZMQ (bounded by :data:`FLUSH_TIMEOUT_S`), so a step's events are
    always on the wire before its outputs are queued.  Cost: one thread handoff
    per step that changed the cache.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from typing import Any

from engines.vllm import core_holds, top_prefill

FLUSH_TIMEOUT_S = 0.05  # longest a step waits for its events to be sent


def _pool(core: Any) -> Any:
    return core_holds.block_pool(core.scheduler)


def _pins(core: Any) -> dict[bytes, Any]:
    pins: dict[bytes, Any] | None = getattr(core, "_vcache_pins", None)
    if pins is None:
        pins = {}
        core._vcache_pins = pins
    return pins


def _publish_pending(core: Any) -> None:
    """Publish events queued outside a scheduler step, keeping the stream in order."""
    from vllm.distributed.kv_events import KVEventBatch

    events = _pool(core).take_events()
    publisher = getattr(core.scheduler, "kv_event_publisher", None)
    if events and publisher is not None:
        publisher.publish(KVEventBatch(ts=time.time(), events=events))


def _holds(core: Any) -> dict[bytes, dict[str, float]]:
    """Per pinned block, who holds it (a gateway's id) until when (this process's
    monotonic clock; ``inf``: until released).  A block stays pinned while any hold is
    live, so gateways sharing a replica never release each other's pins, and a gateway
    that died without releasing its own leaks nothing: its holds run out."""
    holds: dict[bytes, dict[str, float]] | None = getattr(core, "_vcache_holds", None)
    if holds is None:
        holds = {}
        core._vcache_holds = holds
    return holds


def _free(core: Any, h: bytes) -> bool:
    _holds(core).pop(h, None)
    block = _pins(core).pop(h, None)
    if block is None:
        return False
    _pool(core).free_blocks([block])
    return True


def vcache_sweep(core: Any) -> dict[str, Any]:
    """Release every block whose holds have all run out.  Every pin and unpin sweeps
    first, so the walk over all holds runs only once the soonest of them has ended."""
    now = time.monotonic()
    core_holds.expire(core.scheduler, now)  # request holds past their bound (one per request)
    if now < getattr(core, "_vcache_sweep_at", 0.0):
        return {"unpinned": []}
    released = []
    soonest = math.inf
    for h, by in list(_holds(core).items()):
        for holder in [k for k, until in by.items() if until <= now]:
            del by[holder]
        if by:
            soonest = min(soonest, *by.values())
        elif _free(core, h):
            released.append(h)
    core._vcache_sweep_at = soonest
    return {"unpinned": released}


def vcache_hold(
    core: Any, hold_id: str, hashes: list[bytes], max_share: float, reserve: int, ttl_s: float
) -> dict[str, Any]:
    """Hold the leading resident blocks of ``hashes`` for ``hold_id`` (all or nothing)."""
    return core_holds.take(core.scheduler, hold_id, hashes, max_share, reserve, ttl_s)


def vcache_release(core: Any, hold_ids: list[str]) -> dict[str, Any]:
    """Let the holds ``hold_ids`` go (and any that ran out); how many blocks were freed."""
    sched = core.scheduler
    freed = core_holds.expire(sched, time.monotonic()) + core_holds.let_go(sched, hold_ids)
    return {"freed": freed}


def vcache_pin(
    core: Any, hashes: list[bytes], max_share: float, holder: str = "", ttl_s: float | None = None
) -> dict[str, Any]:
    """Pin (or, for ``holder``, hold again until ``ttl_s`` from now) each resident block."""
    vcache_sweep(core)
    pool, pins, holds = _pool(core), _pins(core), _holds(core)
    until = float("inf") if ttl_s is None else time.monotonic() + ttl_s
    limit = int(pool.num_gpu_blocks * max_share)
    pinned: list[bytes] = []
    already: list[bytes] = []
    missing: list[bytes] = []
    refused: list[bytes] = []
    for h in hashes:
        if h in pins:
            already.append(h)
        elif (block := core_holds.lookup(pool, h)) is None:
            missing.append(h)
            continue
        elif len(pins) >= limit:
            refused.append(h)
            continue
        else:
            pool.touch([block])
            pins[h] = block
            pinned.append(h)
        by = holds.setdefault(h, {})
        by[holder] = max(by.get(holder, until), until)
        core._vcache_sweep_at = min(getattr(core, "_vcache_sweep_at", until), until)
    return {"pinned": pinned, "already": already, "missing": missing, "refused": refused}


def vcache_unpin(core: Any, hashes: list[bytes], holder: str | None = None) -> dict[str, Any]:
    """Drop ``holder``'s hold (every hold when None); release the blocks nobody holds
    any more, which become evictable (most recently used end of the free queue)."""
    released = vcache_sweep(core)["unpinned"]
    holds = _holds(core)
    for h in hashes:
        by = holds.get(h, {})
        if holder is not None:
            by.pop(holder, None)
        if (holder is None or not by) and _free(core, h):
            released.append(h)
    return {"unpinned": released}


def vcache_touch(core: Any, hashes: list[bytes]) -> dict[str, Any]:
    """Move the resident blocks of ``hashes`` (a prompt's, in order) that no request or
    pin holds to the most recently used end of the free queue, the first block last:
    evicted after every other free block.  Held blocks are not in the queue and stay
    as they are.  Nothing is pinned, so nothing is ever kept from a request that needs
    the room."""
    pool = _pool(core)
    blocks = []
    missing: list[bytes] = []
    for h in hashes:
        block = core_holds.lookup(pool, h)
        if block is None:
            missing.append(h)
        else:
            blocks.append(block)
    pool.touch(blocks)  # out of the free queue (a reference each) ...
    pool.free_blocks(blocks[::-1])  # ... and back in at its end, the prefix's tail first
    return {"touched": len(blocks), "missing": missing}


def vcache_evict(core: Any, hashes: list[bytes]) -> dict[str, Any]:
    pool, pins = _pool(core), _pins(core)
    evicted: list[bytes] = []
    busy: list[bytes] = []
    for h in hashes:
        block = core_holds.lookup(pool, h)
        if block is None:
            continue
        if block.ref_cnt > 0 or h in pins:
            busy.append(h)  # a running request or a pin holds it
        elif pool._maybe_evict_cached_block(block):
            evicted.append(h)
    _publish_pending(core)
    return {"evicted": evicted, "busy": busy}


def vcache_cache_stats(core: Any) -> dict[str, Any]:
    pool = _pool(core)
    held_blocks, holds = core_holds.counts(core.scheduler)
    return {
        "block_size": int(pool.hash_block_size),
        "num_blocks": int(pool.num_gpu_blocks),
        "free_blocks": int(pool.get_num_free_blocks()),
        "cached_blocks": len(pool.cached_block_hash_to_block),
        "pinned_blocks": len(_pins(core)),
        "holders": len({k for by in _holds(core).values() for k in by}),
        "held_blocks": held_blocks,  # request holds (engines/vllm/core_holds.py)
        "holds": holds,
        "usage": float(pool.get_usage()),
        # steps the top-first scheduler changed (engines/vllm/top_first_scheduler.py;
        # empty under vLLM's own scheduler)
        "top_prefill_steps": dict(getattr(core.scheduler, top_prefill.STEPS, {})),
    }


def vcache_events_barrier(core: Any, timeout_s: float = 2.0) -> int:
    """Wait until every KV event queued so far has been sent; return the last sequence number.

    A client that then waits for that sequence on its subscriber has seen every
    event of every step that ran before this call (-1: nothing published yet).
    """
    publisher = getattr(core.scheduler, "kv_event_publisher", None)
    queue = getattr(publisher, "_event_queue", None)
    deadline = time.monotonic() + timeout_s
    while queue is not None and queue.unfinished_tasks and time.monotonic() < deadline:
        time.sleep(0.0005)
    buffer = getattr(publisher, "_buffer", None)
    return int(buffer[-1][0]) if buffer else -1


def in_order(
    publish: Callable[[Any, Any], None], timeout_s: float = FLUSH_TIMEOUT_S
) -> Callable[[Any, Any], None]:
    """Wrap ``ZmqEventPublisher.publish`` to return once the sender thread has sent the batch."""

    @functools.wraps(publish)
    def publish_in_order(publisher: Any, events: Any) -> None:
        publish(publisher, events)
        queue = publisher._event_queue
        deadline = time.monotonic() + timeout_s
        while queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.0001)  # releases the GIL to the sender thread

    publish_in_order.vcache_in_order = True  # type: ignore[attr-defined]
    return publish_in_order


def vcache_resident(core: Any) -> list[bytes]:
    """Every block hash resident in the prefix cache (group 0)."""
    from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id

    cache = _pool(core).cached_block_hash_to_block._cache
    return [bytes(get_block_hash(k)) for k in cache if get_group_id(k) == core_holds.GROUP]


_METHODS = {
    "vcache_pin": vcache_pin,
    "vcache_unpin": vcache_unpin,
    "vcache_sweep": vcache_sweep,
    "vcache_hold": vcache_hold,
    "vcache_release": vcache_release,
    "vcache_evict": vcache_evict,
    "vcache_touch": vcache_touch,
    "vcache_cache_stats": vcache_cache_stats,
    "vcache_resident": vcache_resident,
    "vcache_events_barrier": vcache_events_barrier,
}


def register() -> None:
    """Entry point: tie this process's life to the gateway's (engines/vllm/lifeline.py),
    then add the methods to EngineCore (safe to call many times)."""
    from vllm.v1.engine.core import EngineCore

    from engines.vllm.lifeline import die_with_parent
    from engines.vllm.niceness import apply_from_env

    die_with_parent()
    apply_from_env()  # the niceness the gateway gave its engines (none: as it was)

    for name, fn in _METHODS.items():
        if getattr(EngineCore, name, None) is not fn:
            setattr(EngineCore, name, fn)

    from vllm.distributed.kv_events import ZmqEventPublisher

    if not getattr(ZmqEventPublisher.publish, "vcache_in_order", False):
        ZmqEventPublisher.publish = in_order(ZmqEventPublisher.publish)  # type: ignore[method-assign,assignment]
