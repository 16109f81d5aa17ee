"""The engine plugin's pin holds: several gateways on one replica, and holds that run out
(a gateway that died holding pins leaks nothing)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from engines.vllm import plugin


class Pool:
    """The parts of vLLM's BlockPool the plugin uses: one reference per pin."""

    def __init__(self, resident: list[bytes], blocks: int = 10) -> None:
        self.num_gpu_blocks = blocks
        self.refs = {h: 0 for h in resident}

    def get_cached_block(self, h: bytes, groups: list[int]) -> list[Any] | None:
        return [bytes(h)] if bytes(h) in self.refs else None

    def touch(self, blocks: list[bytes]) -> None:
        for b in blocks:
            self.refs[b] += 1

    def free_blocks(self, blocks: list[bytes]) -> None:
        for b in blocks:
            self.refs[b] -= 1


def _core(pool: Pool) -> Any:
    return SimpleNamespace(
        scheduler=SimpleNamespace(
            kv_cache_manager=SimpleNamespace(coordinator=SimpleNamespace(block_pool=pool))
        )
    )


def test_a_block_stays_pinned_while_any_gateway_holds_it() -> None:
    pool = Pool([b"a", b"b"])
    core = _core(pool)
    assert plugin.vcache_pin(core, [b"a", b"b", b"z"], 0.5, "gw-1", 60)["missing"] == [b"z"]
    assert plugin.vcache_pin(core, [b"a"], 0.5, "gw-2", 60)["already"] == [b"a"]
    assert pool.refs == {b"a": 1, b"b": 1}  # one reference per block, however many holders
    assert plugin.vcache_unpin(core, [b"a", b"b"], "gw-1")["unpinned"] == [b"b"]
    assert pool.refs == {b"a": 1, b"b": 0}  # gw-2 still holds a
    assert plugin.vcache_unpin(core, [b"a"], "gw-2")["unpinned"] == [b"a"]
    assert pool.refs == {b"a": 0, b"b": 0}


def test_holds_run_out_and_a_sweep_releases_them(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = Pool([b"a", b"b"])
    core = _core(pool)
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    plugin.vcache_pin(core, [b"a", b"b"], 0.5, "gw-dead", 30)
    plugin.vcache_pin(core, [b"b"], 0.5, "gw-live", 60)
    now[0] += 29
    assert plugin.vcache_sweep(core)["unpinned"] == []
    now[0] += 2  # gw-dead's holds ran out: a is free, b is still gw-live's
    assert plugin.vcache_sweep(core)["unpinned"] == [b"a"]
    assert pool.refs == {b"a": 0, b"b": 1}
    plugin.vcache_pin(core, [b"b"], 0.5, "gw-live", 60)  # renewed: 60 s from now
    now[0] += 59
    assert plugin.vcache_sweep(core)["unpinned"] == []
    now[0] += 2
    assert plugin.vcache_sweep(core)["unpinned"] == [b"b"] and pool.refs[b"b"] == 0


def test_a_pin_without_holder_holds_until_released_by_anyone() -> None:
    pool = Pool([b"a"])
    core = _core(pool)
    plugin.vcache_pin(core, [b"a"], 0.5)
    assert plugin.vcache_sweep(core)["unpinned"] == []
    assert plugin.vcache_unpin(core, [b"a"])["unpinned"] == [b"a"]  # None: every hold


def test_the_pin_budget_counts_blocks_not_holds() -> None:
    pool = Pool([b"a", b"b", b"c"], blocks=4)  # max_share 0.5: two blocks
    core = _core(pool)
    plugin.vcache_pin(core, [b"a", b"b"], 0.5, "gw-1", 60)
    assert plugin.vcache_pin(core, [b"a", b"b"], 0.5, "gw-2", 60)["already"] == [b"a", b"b"]
    assert plugin.vcache_pin(core, [b"c"], 0.5, "gw-2", 60)["refused"] == [b"c"]


def test_a_sweep_walks_the_holds_only_once_the_soonest_has_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every pin and unpin sweeps first: with thousands of blocks held, walking them all
    each call would cost the engine core a walk per request."""
    pool = Pool([b"a", b"b"])
    core = _core(pool)
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    plugin.vcache_pin(core, [b"a"], 0.5, "gw", 30)
    plugin.vcache_pin(core, [b"b"], 0.5, "gw", 10)  # the soonest
    walks: list[int] = []
    holds = plugin._holds

    def counted(c: Any) -> dict[bytes, dict[str, float]]:
        walks.append(1)
        return holds(c)

    monkeypatch.setattr(plugin, "_holds", counted)
    now[0] += 9
    assert plugin.vcache_sweep(core)["unpinned"] == [] and not walks
    now[0] += 2
    assert plugin.vcache_sweep(core)["unpinned"] == [b"b"] and walks
    seen = len(walks)
    now[0] += 10  # a's hold ends at 1030: no walk before it
    assert plugin.vcache_sweep(core)["unpinned"] == [] and len(walks) == seen
    now[0] += 10
    assert plugin.vcache_sweep(core)["unpinned"] == [b"a"] and len(walks) > seen
    assert pool.refs == {b"a": 0, b"b": 0}


class QueuedPool(Pool):
    """A pool whose free blocks form vLLM's eviction queue: taken from the front,
    freed ones appended at the end."""

    def __init__(self, resident: list[bytes]) -> None:
        super().__init__(resident)
        self.queue = list(resident)  # all free, the first evicted first

    def touch(self, blocks: list[bytes]) -> None:
        for b in blocks:
            if self.refs[b] == 0:
                self.queue.remove(b)
        super().touch(blocks)

    def free_blocks(self, blocks: list[bytes]) -> None:
        super().free_blocks(blocks)
        self.queue += [b for b in blocks if self.refs[b] == 0]


def test_a_touch_makes_a_prompts_blocks_the_last_evicted_and_pins_nothing() -> None:
    pool = QueuedPool([b"a1", b"a2", b"b1", b"b2", b"held"])
    core = _core(pool)
    plugin.vcache_pin(core, [b"held"], 0.5, "gw", 60)
    res = plugin.vcache_touch(core, [b"a1", b"a2", b"held", b"gone"])
    assert res == {"touched": 3, "missing": [b"gone"]}
    # a's blocks now go after b's, its first block last; the pinned block stays out
    assert pool.queue == [b"b1", b"b2", b"a2", b"a1"]
    assert pool.refs == {b"a1": 0, b"a2": 0, b"b1": 0, b"b2": 0, b"held": 1}
