"""LoRA adapters on the local replicas (fake engines): which names are adapters, one load
however many first requests wait for it, a failed load named and the replica serving on,
routing to the replica that holds the adapter, and each adapter's blocks its own."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from engines.base import GenerateRequest, SamplingOptions
from engines.lora import LoraRef
from engines.tokenizer import ChatTokenizer
from gateway.core.errors import InvalidRequest, NotFound, Unavailable
from gateway.core.metrics import Metrics
from gateway.local.adapters import Adapters, weights_digest
from gateway.local.replicas import Replica
from gateway.local.spans import KVSpans
from manifest.hashing import HashKeys, block_hashes
from manifest.index import LocationId
from tests.unit.builders import booted, dispatcher
from tests.unit.local.lora_fake import LoraFakeEngine, adapter_dir

R0, R1 = LocationId("replica-0"), LocationId("replica-1")


@pytest.fixture
def tokenizer(demo_model: Path) -> ChatTokenizer:
    return ChatTokenizer.from_pretrained(str(demo_model))


async def _replicas(tokenizer: ChatTokenizer, n: int = 2) -> list[Replica]:
    out = []
    for i in range(n):
        engine = LoraFakeEngine(tokenizer, block_size=16)
        await engine.start()
        out.append(Replica(LocationId(f"replica-{i}"), engine))
    return out


def _engine(r: Replica) -> LoraFakeEngine:
    assert isinstance(r.engine, LoraFakeEngine)
    return r.engine


def test_names_configured_resolved_and_unknown(tmp_path: Path) -> None:
    a = LoraRef("ad-a", str(adapter_dir(tmp_path / "conf", "ad-a")))
    adapter_dir(tmp_path / "dir", "ad-r")
    rs = booted([])
    adapters = Adapters(rs, "base", [a], tmp_path / "dir", enabled=True)
    assert adapters.find("ad-a") == a
    assert adapters.find("base") is None  # the base model is no adapter
    assert adapters.find("nope") is None
    assert adapters.find("../dir/ad-r") is None  # a name, never a path
    assert adapters.find("ad-r") == LoraRef("ad-r", str(tmp_path / "dir" / "ad-r"))
    assert [x.name for x in adapters.listed()] == ["ad-a", "ad-r"]  # resolved: known now
    with pytest.raises(NotFound) as err:
        adapters.get("nope")
    assert err.value.status == 404 and "'nope'" in str(err.value)
    off = Adapters(rs, "base", [a], tmp_path / "dir", enabled=False)
    assert off.find("ad-a") is None and off.find("ad-r") is None


def test_ten_first_requests_load_an_adapter_once(tokenizer: ChatTokenizer, tmp_path: Path) -> None:
    asyncio.run(_ten_first_requests_load_an_adapter_once(tokenizer, tmp_path))


async def _ten_first_requests_load_an_adapter_once(
    tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    replicas = await _replicas(tokenizer)
    a = LoraRef("ad-a", str(adapter_dir(tmp_path, "ad-a")))
    adapters = Adapters(booted(replicas), "base", [a], None, enabled=True)
    _engine(replicas[0]).load_delay_s = 0.05
    await asyncio.gather(*(adapters.ensure(replicas[0], a) for _ in range(10)))
    assert _engine(replicas[0]).load_calls == [a] and adapters.loads == 1
    assert adapters.where(a) == {R0}
    await adapters.ensure(replicas[0], a)  # held: nothing more
    assert _engine(replicas[0]).load_calls == [a]


def test_a_failed_load_is_named_and_the_replica_serves_on(
    tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    asyncio.run(_a_failed_load_is_named_and_the_replica_serves_on(tokenizer, tmp_path))


async def _a_failed_load_is_named_and_the_replica_serves_on(
    tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    replicas = await _replicas(tokenizer, 1)
    adapters = Adapters(booted(replicas), "base", (), None, enabled=True)
    wide = LoraRef("wide", str(adapter_dir(tmp_path, "wide", rank=64)))
    with pytest.raises(InvalidRequest) as err:
        await adapters.load(wide)
    assert err.value.code == "adapter_load_failed"
    assert "rank 64 is greater than max_lora_rank 8" in str(err.value)
    with pytest.raises(InvalidRequest) as err:
        await adapters.load(LoraRef("gone", str(tmp_path / "missing")))
    assert str(tmp_path / "missing") in str(err.value)
    with pytest.raises(InvalidRequest):  # the base model's name is not an adapter's
        await adapters.load(LoraRef("base", str(adapter_dir(tmp_path, "b"))))
    ok = LoraRef("ok", str(adapter_dir(tmp_path, "ok")))
    assert await adapters.load(ok) == [R0]
    assert replicas[0].engine.ready and adapters.where(ok) == {R0}


def test_unload_on_one_replica_then_everywhere(tokenizer: ChatTokenizer, tmp_path: Path) -> None:
    asyncio.run(_unload_on_one_replica_then_everywhere(tokenizer, tmp_path))


async def _unload_on_one_replica_then_everywhere(tokenizer: ChatTokenizer, tmp_path: Path) -> None:
    replicas = await _replicas(tokenizer)
    adapters = Adapters(booted(replicas), "base", (), None, enabled=True)
    a = LoraRef("ad-a", str(adapter_dir(tmp_path, "ad-a")))
    assert await adapters.load(a) == [R0, R1]
    assert await adapters.unload("ad-a", "replica-1") == [R1]
    assert adapters.where(a) == {R0} and adapters.find("ad-a") == a
    assert await adapters.unload("ad-a") == [R0]
    assert adapters.find("ad-a") is None  # loaded at run time, unloaded everywhere: gone
    with pytest.raises(NotFound):
        await adapters.unload("ad-a")
    with pytest.raises(NotFound):
        await adapters.load(a, "replica-9")


def test_a_restarted_replica_is_asked_again(tokenizer: ChatTokenizer, tmp_path: Path) -> None:
    asyncio.run(_a_restarted_replica_is_asked_again(tokenizer, tmp_path))


async def _a_restarted_replica_is_asked_again(tokenizer: ChatTokenizer, tmp_path: Path) -> None:
    replicas = await _replicas(tokenizer, 1)
    adapters = Adapters(booted(replicas), "base", (), None, enabled=True)
    a = LoraRef("ad-a", str(adapter_dir(tmp_path, "ad-a")))
    await adapters.load(a)
    fresh = LoraFakeEngine(tokenizer, block_size=16)
    await fresh.start()
    replicas[0].engine = fresh  # what the supervisor's swap does
    assert adapters.where(a) == set()  # the new engine holds nothing yet
    await adapters.learn_new()
    assert adapters.where(a) == set()
    await adapters.ensure(replicas[0], a)
    assert fresh.load_calls == [a] and adapters.where(a) == {R0}


def _request(rid: str, ids: list[int], lora: LoraRef | None) -> GenerateRequest:
    return GenerateRequest(rid, tuple(ids), SamplingOptions(max_tokens=1), lora=lora)


def test_routing_prefers_the_replica_that_holds_the_adapter(
    tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    asyncio.run(_routing_prefers_the_replica_that_holds_the_adapter(tokenizer, tmp_path))


async def _routing_prefers_the_replica_that_holds_the_adapter(
    tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    replicas = await _replicas(tokenizer)
    rs = booted(replicas)
    adapters = Adapters(rs, "base", (), None, enabled=True)
    a = LoraRef("ad-a", str(adapter_dir(tmp_path, "ad-a")))
    await adapters.load(a, "replica-1")
    d = dispatcher(rs, Metrics(), router=None)
    for i in range(8):  # whatever the prompt's own affinity
        ids = list(range(i, i + 40))
        got = await d.route(_request(f"r{i}", ids, a), None, among=adapters.where(a))
        d.release(got)
        assert got.replica_id == R1
    plain = set()
    for i in range(8):
        got = await d.route(_request(f"p{i}", [i] * 40, None), None)
        d.release(got)
        plain.add(got.replica_id)
    assert plain == {R0, R1}  # the base model's requests spread as before


def test_each_adapter_hashes_its_own_blocks() -> None:
    """The gateway keys an adapter's blocks as vLLM does, ``("lora", name, path)`` on
    every block (the oracle against vLLM's own hasher: tests/unit/manifest/test_hashing.py):
    the same prompt under two adapters, or under none, shares no block, and a name
    re-pointed at another path shares none with its old weights."""
    kv = KVSpans(16, "0", pin_max_share=0.5, default_lease_s=60)
    prompt = list(range(100))
    a, b = LoraRef("a", "/loras/a"), LoraRef("b", "/loras/b")
    moved = LoraRef("a", "/loras/a-v2")
    ha = kv.hashes(prompt, "t", a)
    assert ha == block_hashes(prompt, 16, "0", HashKeys("t", "a", "/loras/a"))
    others = [
        kv.hashes(prompt, "t", None),
        kv.hashes(prompt, "t", b),
        kv.hashes(prompt, "t", moved),
    ]
    for other in others:
        assert len(other) == len(ha) and not set(other) & set(ha)
    kv.index.apply_stored(R0, ha)  # replica-0 computed the prompt under a
    assert kv.predict(ha, len(prompt)) == {R0: 96}
    for other in others:
        assert kv.predict(other, len(prompt)).get(R0, 0) == 0


def test_a_failed_first_load_fails_every_waiter_once_and_is_tried_again(
    tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    asyncio.run(_failed_first_load(tokenizer, tmp_path))


async def _failed_first_load(tokenizer: ChatTokenizer, tmp_path: Path) -> None:
    replicas = await _replicas(tokenizer, 1)
    adapters = Adapters(booted(replicas), "base", (), None, enabled=True)
    engine = _engine(replicas[0])
    engine.load_delay_s = 0.05
    wide = LoraRef("wide", str(adapter_dir(tmp_path, "wide", rank=64)))
    waiters = [adapters.ensure(replicas[0], wide) for _ in range(5)]
    results = await asyncio.gather(*waiters, return_exceptions=True)
    assert all(isinstance(r, InvalidRequest) for r in results) and len(engine.load_calls) == 1
    # a waiter that leaves does not stop the load the others wait for
    ok = LoraRef("ok", str(adapter_dir(tmp_path, "ok")))
    first = asyncio.ensure_future(adapters.ensure(replicas[0], ok))
    await asyncio.sleep(0)
    second = asyncio.ensure_future(adapters.ensure(replicas[0], ok))
    await asyncio.sleep(0)
    first.cancel()
    await second
    assert adapters.where(ok) == {R0} and engine.load_calls[1:] == [ok]
    with pytest.raises(InvalidRequest):  # tried again, not the old failure remembered
        await adapters.ensure(replicas[0], wide)
    assert len(engine.load_calls) == 3


def test_an_adapter_nobody_holds_goes_where_a_slot_is_free(
    tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    asyncio.run(_free_slot(tokenizer, tmp_path))


async def _free_slot(tokenizer: ChatTokenizer, tmp_path: Path) -> None:
    replicas = await _replicas(tokenizer)
    rs = booted(replicas)
    adapters = Adapters(rs, "base", (), None, enabled=True, slots=1)
    a = LoraRef("a", str(adapter_dir(tmp_path, "a")))
    b = LoraRef("b", str(adapter_dir(tmp_path, "b")))
    assert adapters.candidates(b) == set()  # nothing known yet: any replica
    await adapters.load(a, "replica-0")  # replica-0's one slot is taken
    await adapters.learn_new()
    assert adapters.candidates(a) == {R0}
    assert adapters.candidates(b) == {R1}  # loading b there lets nothing go
    d = dispatcher(rs, Metrics())
    for i in range(4):
        got = await d.route(_request(f"b{i}", list(range(i, i + 40)), b), None, among={R1})
        d.release(got)
        assert got.replica_id == R1
    unbounded = Adapters(rs, "base", (), None, enabled=True)
    await unbounded.learn_new()
    (one,) = unbounded.candidates(b)  # slots not known: one of them, by b's name
    assert one in (R0, R1) and unbounded.candidates(b) == {one}


def test_weights_digest_covers_every_file_by_name_and_bytes(tmp_path: Path) -> None:
    d = adapter_dir(tmp_path, "ad-a")
    (d / "adapter_model.safetensors").write_bytes(b"w1")
    one = weights_digest(d)
    assert one is not None and len(one) == 64 and weights_digest(d) == one
    (d / "adapter_model.safetensors").write_bytes(b"w2")
    assert weights_digest(d) not in (one, None)
    (d / "adapter_model.safetensors").write_bytes(b"w1")
    assert weights_digest(d) == one  # the bytes, not the file's times
    (d / "adapter_model.safetensors").rename(d / "other.safetensors")
    assert weights_digest(d) != one  # a file's name is part of it
    assert weights_digest(tmp_path / "nowhere") is None


def test_a_request_recorded_with_weights_a_load_finds_changed_is_refused(
    tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    asyncio.run(_recorded_weights_changed_at_load(tokenizer, tmp_path))


async def _recorded_weights_changed_at_load(tokenizer: ChatTokenizer, tmp_path: Path) -> None:
    (r0,) = await _replicas(tokenizer, 1)
    d = adapter_dir(tmp_path, "ad-a")
    (d / "adapter_model.safetensors").write_bytes(b"w1")
    adapters = Adapters(booted([r0]), "base", [LoraRef("ad-a", str(d))], None, enabled=True)
    asked = adapters.find("ad-a")  # read once, when it became known
    assert asked is not None and asked.sha256 == weights_digest(d) == adapters.digest(asked)
    (d / "adapter_model.safetensors").write_bytes(b"w2")
    same = adapters.find("ad-a")  # not per request: what was read
    assert same is not None and same.sha256 == asked.sha256
    with pytest.raises(Unavailable) as err:  # the load reads the new weights
        await adapters.ensure(r0, asked)
    assert err.value.code == "adapter_changed" and "'ad-a'" in str(err.value)
    assert _engine(r0).held["ad-a"] == asked  # loaded all the same
    again = adapters.find("ad-a")
    assert again is not None and again.sha256 == weights_digest(d) != asked.sha256
    await adapters.ensure(r0, again)  # recorded with what is loaded: sent
    assert len(_engine(r0).load_calls) == 1
