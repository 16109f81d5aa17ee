"""How the embedded engine is configured (no engine is started here)."""

from __future__ import annotations

import pytest

from engines.vllm.engine_config import (
    CPU_DEFAULT_KV_CACHE_BYTES,
    HASH_ALGO,
    VllmEngineConfig,
    engine_args,
)


def test_prefix_caching_is_always_on_with_the_manifest_hash() -> None:
    args = engine_args(VllmEngineConfig(model="m", served_name="s"))
    assert args.enable_prefix_caching is True
    assert args.prefix_caching_hash_algo == HASH_ALGO == "sha256_cbor"


def test_cpu_sizes_the_kv_cache_instead_of_reserving_a_memory_share() -> None:
    # this machine runs the CPU build: an unset size becomes the CPU default
    args = engine_args(VllmEngineConfig(model="m", served_name="s"))
    assert args.kv_cache_memory_bytes == CPU_DEFAULT_KV_CACHE_BYTES
    sized = VllmEngineConfig(model="m", served_name="s", kv_cache_bytes=64 << 20)
    assert engine_args(sized).kv_cache_memory_bytes == 64 << 20


def test_kv_events_config_when_endpoints_are_given() -> None:
    cfg = VllmEngineConfig(
        model="m",
        served_name="s",
        kv_events_endpoint="ipc:///tmp/e",
        kv_events_replay_endpoint=None,
    )
    ev = engine_args(cfg).kv_events_config
    assert ev.enable_kv_cache_events and ev.publisher == "zmq" and ev.endpoint == "ipc:///tmp/e"
    assert engine_args(VllmEngineConfig(model="m", served_name="s")).kv_events_config is None


def test_a_prefill_chunk_cap_when_one_is_set() -> None:
    capped = VllmEngineConfig(model="m", served_name="s", long_prefill_token_threshold=256)
    assert engine_args(capped).long_prefill_token_threshold == 256
    assert (
        engine_args(VllmEngineConfig(model="m", served_name="s")).long_prefill_token_threshold == 0
    )


def test_the_top_prefill_patch_reaches_the_core_through_its_environment() -> None:
    from engines.vllm import top_prefill
    from engines.vllm.engine_config import core_environment

    placed = (("CUDA_VISIBLE_DEVICES", "1"),)
    on = VllmEngineConfig(
        model="m", served_name="s", placement=placed, top_prefill_whole=True, nice=0
    )
    assert core_environment(on) == (*placed, (top_prefill.ENV, "1"))
    both = VllmEngineConfig(
        model="m", served_name="s", placement=placed, top_prefill_whole=True,
        top_prefill_alone=True, nice=0,
    )  # fmt: skip
    assert core_environment(both) == (*placed, (top_prefill.ENV, "1"), (top_prefill.ALONE_ENV, "1"))
    decodes = VllmEngineConfig(
        model="m", served_name="s", top_prefill_alone=True, top_prefill_decodes=True, nice=0
    )
    held = ((top_prefill.ALONE_ENV, "1"), (top_prefill.DECODES_ENV, "1"))
    assert core_environment(decodes) == held
    off = VllmEngineConfig(model="m", served_name="s", placement=placed, nice=0)
    assert core_environment(off) == placed


def test_the_plugin_installs_the_patch_where_the_environment_asks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    from engines.vllm import plugin, top_prefill

    original = Scheduler.schedule
    monkeypatch.setattr(Scheduler, "schedule", original)  # put back after the test
    monkeypatch.delenv(top_prefill.ENV, raising=False)
    monkeypatch.delenv(top_prefill.ALONE_ENV, raising=False)
    plugin.register()
    assert Scheduler.schedule is original
    monkeypatch.setenv(top_prefill.ENV, "1")
    plugin.register()
    plugin.register()  # once only
    assert getattr(Scheduler.schedule, "vcache_top_prefill", False)
    assert getattr(Scheduler.schedule, "__wrapped__", None) is original


def test_the_plugin_installs_the_hold_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    from engines.vllm import plugin, top_prefill

    original = Scheduler.schedule
    monkeypatch.setattr(Scheduler, "schedule", original)
    monkeypatch.delenv(top_prefill.ENV, raising=False)
    monkeypatch.setenv(top_prefill.ALONE_ENV, "1")
    plugin.register()
    assert getattr(Scheduler.schedule, "vcache_top_prefill", False)
