"""The engine plugin's request holds on vLLM's own BlockPool: a routed request's leading
resident blocks kept from eviction until it is scheduled, all or nothing, bounded in
blocks (a share of the pool, and the room a live request needs) and in time."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from engines.vllm import plugin

block_pool = pytest.importorskip("vllm.v1.core.block_pool")
kv_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")

H = [bytes([i]) * 32 for i in range(1, 9)]  # eight block hashes


def _core(cached: int, blocks: int = 12) -> tuple[Any, Any]:
    """An engine core whose prefix cache holds ``H[:cached]``, every block free (no
    request references them: the least recently used are evicted first)."""
    pool = block_pool.BlockPool(num_gpu_blocks=blocks, enable_caching=True, hash_block_size=16)
    got = pool.get_new_blocks(cached)
    for b, h in zip(got, H, strict=False):
        key = kv_utils.make_block_hash_with_group_id(kv_utils.BlockHash(h), 0)
        b.set_block_hash(key)
        pool.cached_block_hash_to_block.insert(key, b)
    pool.free_blocks(got)
    core = SimpleNamespace(
        scheduler=SimpleNamespace(
            kv_cache_manager=SimpleNamespace(coordinator=SimpleNamespace(block_pool=pool))
        )
    )
    return core, pool


def _cached(pool: Any) -> list[bytes]:
    return [h for h in H if pool.get_cached_block(kv_utils.BlockHash(h), [0])]


def _pressure(pool: Any) -> None:
    """Requests that run meanwhile take every free block (the least recent first)."""
    pool.free_blocks(pool.get_new_blocks(pool.get_num_free_blocks()))


def test_held_blocks_survive_the_pressure_that_evicts_the_rest() -> None:
    core, pool = _core(cached=4)
    assert plugin.vcache_hold(core, "gw:1", H[:3], 0.5, 0, 10) == {"held": 3, "refused": ""}
    _pressure(pool)
    assert _cached(pool) == H[:3]  # the fourth, not held, was taken
    assert plugin.vcache_release(core, ["gw:1"]) == {"freed": 3}
    _pressure(pool)
    assert _cached(pool) == []  # released: evictable again


def test_without_a_hold_the_same_pressure_evicts_them() -> None:
    _, pool = _core(cached=4)
    _pressure(pool)
    assert _cached(pool) == []


def test_a_hold_is_the_leading_resident_prefix_shared_by_holds() -> None:
    core, pool = _core(cached=3)
    # H[3] is not resident: the prefix ends there, whatever follows
    assert plugin.vcache_hold(core, "a", H[:6], 0.5, 0, 10)["held"] == 3
    assert plugin.vcache_hold(core, "b", H[:2], 0.5, 0, 10)["held"] == 2
    assert plugin.vcache_cache_stats(core)["held_blocks"] == 3  # one reference a block
    assert plugin.vcache_hold(core, "a", H[:2], 0.5, 0, 10)["refused"] == "duplicate"
    plugin.vcache_release(core, ["a"])
    _pressure(pool)
    assert _cached(pool) == H[:2]  # b still holds two
    plugin.vcache_release(core, ["b", "unknown"])
    assert plugin.vcache_cache_stats(core)["held_blocks"] == 0
    assert plugin.vcache_hold(core, "c", [b"\0" * 32], 0.5, 0, 10) == {"held": 0, "refused": ""}


def test_bounded_by_a_share_of_the_pool_and_a_live_requests_room() -> None:
    core, _ = _core(cached=6, blocks=12)  # 11 usable blocks (vLLM keeps a null block)
    assert plugin.vcache_hold(core, "a", H[:4], 0.5, 0, 10)["held"] == 4
    # 4 held + 2 more > 4 (40% of 12): all or nothing, so nothing
    assert plugin.vcache_hold(core, "b", H[:6], 0.4, 0, 10) == {"held": 0, "refused": "budget"}
    assert plugin.vcache_cache_stats(core)["held_blocks"] == 4
    # 7 free blocks; holding 2 more leaves 5, fewer than the 6 the longest request needs
    assert plugin.vcache_hold(core, "c", H[:6], 1.0, 6, 10) == {"held": 0, "refused": "reserve"}
    assert plugin.vcache_hold(core, "d", H[:6], 1.0, 5, 10)["held"] == 6


def test_a_hold_nobody_gives_back_runs_out(monkeypatch: pytest.MonkeyPatch) -> None:
    core, pool = _core(cached=3)
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    plugin.vcache_hold(core, "lost", H[:3], 0.5, 0, 10)
    now[0] += 9
    plugin.vcache_sweep(core)
    assert plugin.vcache_cache_stats(core)["held_blocks"] == 3
    now[0] += 2  # its bound: the reaper's sweep lets it go
    plugin.vcache_sweep(core)
    assert plugin.vcache_cache_stats(core) | {"held_blocks": 0, "holds": 0} == (
        plugin.vcache_cache_stats(core)
    )
    _pressure(pool)
    assert _cached(pool) == []
