"""How the embedded engine is configured (no engine is started here)."""

from __future__ import annotations

from engines.vllm.engine import CPU_DEFAULT_KV_CACHE_BYTES, HASH_ALGO, VllmEngineConfig, engine_args


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
