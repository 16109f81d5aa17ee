"""How the embedded engine is configured (no engine is started here)."""

from __future__ import annotations

import importlib

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


def test_what_is_on_reaches_the_core_through_its_environment() -> None:
    from engines.vllm import top_prefill
    from engines.vllm.engine_config import core_environment

    placed = (("CUDA_VISIBLE_DEVICES", "1"),)
    on = VllmEngineConfig(
        model="m", served_name="s", placement=placed, top_prefill_whole=True, nice=0
    )
    assert core_environment(on) == (*placed, (top_prefill.ENV, "1"))
    both = VllmEngineConfig(
        model="m",
        served_name="s",
        placement=placed,
        top_prefill_whole=True,
        top_prefill_alone=True,
        nice=0,
    )
    assert core_environment(both) == (*placed, (top_prefill.ENV, "1"), (top_prefill.ALONE_ENV, "1"))
    decodes = VllmEngineConfig(
        model="m", served_name="s", top_prefill_alone=True, top_prefill_decodes=True, nice=0
    )
    held = ((top_prefill.ALONE_ENV, "1"), (top_prefill.DECODES_ENV, "1"))
    assert core_environment(decodes) == held
    off = VllmEngineConfig(model="m", served_name="s", placement=placed, nice=0)
    assert core_environment(off) == placed


@pytest.mark.parametrize(
    ("whole", "alone", "decodes", "named"),
    [
        (False, False, False, False),  # vLLM's own scheduler, chosen by vLLM
        (True, False, False, True),
        (False, True, False, True),
        (False, True, True, True),
        (True, True, True, True),
        (False, False, True, False),  # decodes goes with alone: alone it changes no step
    ],
)
def test_the_engine_args_name_the_scheduler_class_when_a_setting_is_on(
    whole: bool, alone: bool, decodes: bool, named: bool
) -> None:
    from engines.vllm.top_prefill import SCHEDULER_CLS

    cfg = VllmEngineConfig(
        model="m",
        served_name="s",
        top_prefill_whole=whole,
        top_prefill_alone=alone,
        top_prefill_decodes=decodes,
    )
    assert engine_args(cfg).scheduler_cls == (SCHEDULER_CLS if named else None)


def test_vllm_resolves_the_named_class_to_the_top_first_scheduler() -> None:
    from vllm.config import SchedulerConfig

    from engines.vllm.top_first_scheduler import TopFirstScheduler
    from engines.vllm.top_prefill import SCHEDULER_CLS

    config = SchedulerConfig.default_factory(scheduler_cls=SCHEDULER_CLS)
    assert config.get_scheduler_cls() is TopFirstScheduler  # as the engine core builds it


def test_the_plugin_leaves_vllms_scheduler_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from engines.vllm import plugin, top_prefill

    original = Scheduler.__dict__["schedule"]
    for name in (top_prefill.ENV, top_prefill.ALONE_ENV, top_prefill.DECODES_ENV):
        monkeypatch.setenv(name, "1")  # everything on, as the gateway sets a core
    importlib.reload(plugin)
    plugin.register()
    assert Scheduler.__dict__["schedule"] is original
    assert Scheduler.schedule.__module__ == "vllm.v1.core.sched.scheduler"
    assert not hasattr(Scheduler.schedule, "__wrapped__")
    assert "schedule" not in AsyncScheduler.__dict__  # vLLM's, inherited


def test_the_charts_replicas_name_the_class_and_the_variables_it_reads() -> None:
    from pathlib import Path

    import yaml

    from engines.vllm import top_prefill

    chart = Path(__file__).resolve().parents[3] / "deploy" / "helm" / "vcache"
    replicas = (chart / "templates" / "vllm-statefulset.yaml").read_text()
    assert f"--scheduler-cls={top_prefill.SCHEDULER_CLS}" in replicas
    for name in (top_prefill.ENV, top_prefill.ALONE_ENV, top_prefill.DECODES_ENV):
        assert f'{{name: {name}, value: "1"}}' in replicas, name
    values = yaml.safe_load((chart / "values.yaml").read_text())["vllm"]["topPrefill"]
    assert values == {"whole": False, "alone": False, "decodes": False}  # as they have run


def test_vllms_environment_is_read_afresh_while_an_engine_starts_then_cached(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm import envs

    from engines.vllm.engine import environment_read_afresh

    monkeypatch.setenv("VLLM_COMPUTE_NANS_IN_LOGITS", "0")
    try:
        with environment_read_afresh():
            monkeypatch.setenv("VLLM_COMPUTE_NANS_IN_LOGITS", "1")
            assert envs.VLLM_COMPUTE_NANS_IN_LOGITS  # read as it is now
        monkeypatch.setenv("VLLM_COMPUTE_NANS_IN_LOGITS", "0")
        assert envs.VLLM_COMPUTE_NANS_IN_LOGITS  # cached as it was when the engine ran
    finally:
        envs.disable_envs_cache()
    assert not envs.VLLM_COMPUTE_NANS_IN_LOGITS
