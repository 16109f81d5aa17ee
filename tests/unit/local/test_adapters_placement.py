"""Where a request under a LoRA adapter may go (gateway/local/adapter_placement.py): the
replicas that hold it, one that must load it only when its cache hit outweighs the
load, one replica for an adapter nobody holds (the same for every first request),
a free slot before letting another adapter go; and the policy on the adapters' state:
concurrent first requests load it once, a full replica lets its least recently used
unleased adapter go, never a leased one."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from engines.base import GenerateRequest, SamplingOptions
from engines.lora import LoraRef
from engines.tokenizer import ChatTokenizer
from gateway.core.errors import Unavailable
from gateway.local.adapter_placement import LoadCost, Option, load_tokens, place
from gateway.local.adapters import Adapters
from gateway.local.replicas import Replica
from gateway.local.spans import KVSpans
from manifest.index import LocationId
from tests.unit.builders import booted
from tests.unit.local.fake_core import Clock, FakeCore
from tests.unit.local.lora_fake import LoraFakeEngine, adapter_dir

R0, R1, R2 = LocationId("replica-0"), LocationId("replica-1"), LocationId("replica-2")


def test_the_replicas_that_hold_it_unless_a_load_buys_more_hit() -> None:
    # R0 holds it with 100 of 1000 tokens cached; R1 can load it with 900 cached (blocks
    # left from before an unload), R2 with none
    opts = [Option(R0, 100, True, True), Option(R1, 900, False, True), Option(R2, 0, False, True)]
    assert place(opts, 1000, 500) == {R0, R1}  # 900 left to prefill vs 100 + 500 load
    assert place(opts, 1000, 800) == {R0}  # the load costs more than the hit it gives
    assert place(opts[:1] + opts[2:], 1000, 0) == {R0}  # no hit to buy: where it is
    both = [Option(R0, 0, True, True), Option(R1, 0, True, False)]
    assert place(both, 1000, 500) == {R0, R1}  # every holder: the router weighs load


def test_nobody_holds_it_one_replica_by_the_adapters_name() -> None:
    opts = [Option(r, 0, False, True) for r in (R0, R1, R2)]
    one = place(opts, 500, 100, "ad-a")
    assert len(one) == 1 and all(place(opts, 500, 100, "ad-a") == one for _ in range(3))
    names = {next(iter(place(opts, 500, 100, f"ad-{i}"))) for i in range(30)}
    assert names == {R0, R1, R2}  # different adapters spread
    warm = [Option(R0, 0, False, True), Option(R1, 256, False, True)]
    assert place(warm, 500, 100, "ad-a") == {R1}  # its blocks outlived an unload there


def test_a_free_slot_before_letting_another_adapter_go_and_never_a_full_leased_one() -> None:
    opts = [Option(R0, 0, False, True, free=False), Option(R1, 0, False, True, free=True)]
    assert place(opts, 500, 100, "x") == {R1}
    assert place([Option(R0, 0, False, True, free=False)], 500, 100, "x") == {R0}
    assert place([Option(R0, 0, False, False, free=False)], 500, 100, "x") == set()


def test_a_loads_cost_in_tokens_is_its_measured_seconds_at_the_prefill_rate() -> None:
    assert load_tokens(LoadCost(10 << 20, 0.25), 1e-3) == 250
    assert load_tokens(None, 1e-3) == 1000  # never loaded: a default second
    assert load_tokens(LoadCost(1, 5.0), 0.0) == 0


@pytest.fixture
def tokenizer(demo_model: Path) -> ChatTokenizer:
    return ChatTokenizer.from_pretrained(str(demo_model))


async def _replicas(tokenizer: ChatTokenizer, n: int) -> list[Replica]:
    out = []
    for i in range(n):
        engine = LoraFakeEngine(tokenizer, block_size=16)
        await engine.start()
        out.append(Replica(LocationId(f"replica-{i}"), engine))
    return out


def _engine(r: Replica) -> LoraFakeEngine:
    assert isinstance(r.engine, LoraFakeEngine)
    return r.engine


def _greq(rid: str, lora: LoraRef) -> GenerateRequest:
    return GenerateRequest(rid, tuple(range(64)), SamplingOptions(max_tokens=1), lora=lora)


def test_ten_concurrent_first_requests_over_three_replicas_load_it_once(
    tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    asyncio.run(_ten_first(tokenizer, tmp_path))


async def _ten_first(tokenizer: ChatTokenizer, tmp_path: Path) -> None:
    replicas = await _replicas(tokenizer, 3)
    adapters = Adapters(booted(replicas), "base", (), None, enabled=True, slots=2)
    await adapters.learn_new()
    a = LoraRef("ad-a", str(adapter_dir(tmp_path, "ad-a")))
    for r in replicas:
        _engine(r).load_delay_s = 0.05
    by_id = {r.id: r for r in replicas}

    async def first(i: int) -> LocationId:
        (where,) = adapters.candidates(a, _greq(f"r{i}", a))  # one replica, whoever asks
        await adapters.ensure(by_id[where], a)
        return where

    got = await asyncio.gather(*(first(i) for i in range(10)))
    assert len(set(got)) == 1 and adapters.loads == 1
    assert sum(len(_engine(r).load_calls) for r in replicas) == 1
    assert adapters.costs["ad-a"].seconds >= 0.05 and adapters.costs["ad-a"].bytes > 0


def test_a_full_replica_lets_its_least_recently_used_unleased_adapter_go(
    tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    asyncio.run(_make_room(tokenizer, tmp_path))


async def _make_room(tokenizer: ChatTokenizer, tmp_path: Path) -> None:
    (r0,) = await _replicas(tokenizer, 1)
    now = [0.0]
    adapters = Adapters(booted([r0]), "base", (), None, enabled=True, slots=2, clock=lambda: now[0])
    a, b, c, d = (LoraRef(n, str(adapter_dir(tmp_path, n))) for n in "abcd")
    await adapters.ensure(r0, a)
    await adapters.ensure(r0, b)
    await adapters.ensure(r0, a)  # b is now the least recently used
    adapters.lease(R0, "b", "sess-1", lease_s=30)  # pinned spans under b
    await adapters.ensure(r0, c)  # full: a goes (b is leased, though older)
    assert set(_engine(r0).held) == {"b", "c"} and adapters.evictions == 1
    adapters.lease(R0, "c", "sess-2", lease_s=10)
    assert R0 not in adapters.candidates(d)  # every slot leased: it cannot load here
    with pytest.raises(Unavailable) as err:
        await adapters.ensure(r0, d)
    assert err.value.code == "adapter_slots_leased" and "'d'" in str(err.value)
    assert set(_engine(r0).held) == {"b", "c"}  # nothing let go
    now[0] = 11.0  # c's lease ended
    await adapters.ensure(r0, d)
    assert set(_engine(r0).held) == {"b", "d"} and adapters.evictions == 2
    adapters.unlease(R0, "b", "sess-1")
    assert not adapters.leased(R0, "b")


def test_a_pin_on_an_adapters_blocks_leases_it_whoever_pinned_them(
    tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    asyncio.run(_pinned_blocks(tokenizer, tmp_path))


async def _pinned_blocks(tokenizer: ChatTokenizer, tmp_path: Path) -> None:
    (r0,) = await _replicas(tokenizer, 1)
    clock = Clock()
    kv = KVSpans(16, "0", pin_max_share=0.5, default_lease_s=60, clock=clock)
    b = LoraRef("b", str(adapter_dir(tmp_path, "b")))
    greq = _greq("s1", b)
    hashes = kv.hashes(greq.prompt_token_ids, greq.cache_salt, b)
    base = kv.hashes(greq.prompt_token_ids, greq.cache_salt)  # the base model's
    kv.attach(R0, FakeCore(hashes[:2] + base[:2], 10), f"ipc://{tmp_path}/none", None)
    kv.index.apply_stored(R0, hashes[:2] + base[:2])
    try:
        adapters = Adapters(booted([r0], kv), "base", (), None, enabled=True, slots=2)
        adapters.candidates(b, greq)  # a request under b: its first block is kept
        assert not adapters.leased(R0, "b")
        other = await kv.pin(R0, base[:2], "other")  # the same tokens, not under b
        assert other.pinned and not adapters.leased(R0, "b")
        session = await kv.pin(R0, hashes[:2], "agent-session")  # e.g. a tool call's pause
        assert session.pinned and adapters.leased(R0, "b") and adapters.leased_on("b") == [R0]
        await kv.unpin(R0, hashes[:2], "agent-session")
        assert not adapters.leased(R0, "b")
    finally:
        await kv.close()
