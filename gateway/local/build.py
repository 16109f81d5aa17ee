"""Build the configured local replicas: the demo model when no model is configured (and
its demo LoRA adapters when asked); the adapters the replicas serve."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

from engines.lora import LoraRef
from engines.vllm.demo_lora import ensure_demo_loras
from engines.vllm.demo_model import ensure_demo_model
from engines.vllm.engine import VllmEngine
from engines.vllm.engine_config import VllmEngineConfig
from engines.vllm.placement import Env, host_units, plan
from engines.vllm.remote import RemoteVllmConfig, RemoteVllmEngine
from engines.vllm.shared_core import CoreSlot
from gateway.core.config import Settings
from gateway.local.adapters import Adapters
from gateway.local.replica_set import ReplicaSet
from gateway.local.replicas import Replica
from gateway.local.vision_prompt import (
    IMAGES_PER_PROMPT,
    RebuildExpander,
    VisionRenderer,
    is_vision_model,
)
from manifest.index import LocationId

log = logging.getLogger(__name__)


def resolve_model(settings: Settings) -> str:
    """A local path or hub id; builds (once) and returns the demo model if none is set."""
    if settings.model:
        return settings.model
    path = ensure_demo_model(settings.data_dir)
    log.info("no model configured: serving the demo model (random weights) from %s", path)
    return str(path)


def start_adapters(settings: Settings, model: str) -> tuple[LoraRef, ...]:
    """The LoRA adapters every embedded engine loads at its start: ``engine.lora.adapters``
    and, serving the demo model with ``engine.lora.demo_adapters``, its two demo adapters
    (built once).  None when LoRA is off."""
    lora = settings.engine.lora
    if not lora.enabled:
        return ()
    out = [LoraRef(name, path) for name, path in lora.adapters.items()]
    if lora.demo_adapters and not settings.model:
        demo = ensure_demo_loras(settings.data_dir, Path(model))
        out += [
            LoraRef(name, str(path)) for name, path in demo.items() if name not in lora.adapters
        ]
    return tuple(out)


def build_adapters(settings: Settings, replicas: ReplicaSet) -> Adapters:
    """The adapters the local replicas serve as models (``engine.lora``)."""
    lora = settings.engine.lora
    enabled = lora.enabled and settings.has_local
    configured = start_adapters(settings, resolve_model(settings)) if enabled else ()
    resolver = Path(lora.resolver_dir) if lora.resolver_dir else None
    slots = lora.max_cpu_loras or lora.max_loras  # vLLM's max_cpu_loras defaults so
    return Adapters(replicas, settings.model_name, configured, resolver, enabled, slots)


def _vision_model(settings: Settings) -> str | None:
    """The configured model when it is a vision-language model and every replica takes
    images (a remote replica configured for vLLM's completions route takes none); else
    None."""
    model = settings.model
    if not model or not settings.has_local:
        return None
    if any(r.api == "completions" for r in settings.remote_replicas):
        return None
    return model if is_vision_model(model) else None


def vision_renderer(settings: Settings) -> VisionRenderer | None:
    """The image prompts' renderer of :func:`_vision_model` (None: no images locally)."""
    model = _vision_model(settings)
    return VisionRenderer.load(model, model, IMAGES_PER_PROMPT) if model else None


def vision_rebuild(settings: Settings) -> RebuildExpander | None:
    """The session log's rebuild of the local image requests :func:`vision_renderer`
    serves (None: the local model takes no images)."""
    model = _vision_model(settings)
    return RebuildExpander(model, model, IMAGES_PER_PROMPT) if model else None


def engine_configs(settings: Settings, runtime_dir: Path, model: str) -> list[VllmEngineConfig]:
    """The embedded replicas' engines on ``model`` (:func:`resolve_model`), each publishing
    KV events on its own socket in ``runtime_dir``."""
    e = settings.engine
    adapters = start_adapters(settings, model)
    out: list[VllmEngineConfig] = []
    for i, placement in enumerate(_placements(settings)):
        events = f"ipc://{runtime_dir}/replica-{i}.events" if settings.cache.kv_events else None
        replay = f"ipc://{runtime_dir}/replica-{i}.replay" if settings.cache.kv_events else None
        out.append(
            VllmEngineConfig(
                model=model,
                served_name=settings.model_name,
                max_model_len=e.max_model_len,
                block_size=e.block_size,
                kv_cache_bytes=e.kv_cache_bytes,
                gpu_memory_utilization=e.gpu_memory_utilization,
                enforce_eager=e.enforce_eager,
                hash_seed=e.hash_seed,
                # The gateway admits a request first; vLLM's own queue is the backstop.
                max_queued_requests=max(e.admission_room().values()) + 16,
                tensor_parallel_size=e.tensor_parallel_size,
                dtype=e.dtype,
                kv_events_endpoint=events,
                kv_events_replay_endpoint=replay,
                scheduling_policy=e.scheduling_policy,
                max_num_seqs=e.max_num_seqs,
                long_prefill_token_threshold=e.long_prefill_token_threshold,
                output_interval_s=e.output_interval_ms / 1000,
                top_prefill_whole=e.top_prefill_whole,
                top_prefill_alone=e.top_prefill_alone,
                top_prefill_decodes=e.top_prefill_decodes,
                nice=e.nice,
                placement=placement,
                enable_lora=e.lora.enabled,
                max_loras=e.lora.max_loras,
                max_lora_rank=e.lora.max_lora_rank,
                max_cpu_loras=e.lora.max_cpu_loras,
                adapters=adapters,
                max_images_per_prompt=IMAGES_PER_PROMPT if is_vision_model(model) else None,
            )
        )
    return out


def _placements(settings: Settings) -> list[Env]:
    """Each embedded replica's own devices or CPU cores (engines/vllm/placement.py)."""
    e = settings.engine
    if e.placement == "none" or e.replicas == 0:
        return [()] * e.replicas
    explicit = e.placement if isinstance(e.placement, list) else []
    envs = plan(host_units(), e.replicas, e.tensor_parallel_size, explicit)
    for i, env in enumerate(envs):
        if env:
            log.info("replica-%d computes on %s", i, " ".join(f"{k}={v}" for k, v in env))
    return envs


def guard_scope(settings: Settings) -> str | None:
    """``"host"`` where the embedded replicas' first-token guards act together
    (``engine.guard_scope``; unset: on a CPU host, whose cores their engines share),
    else None (each replica's guard on its own)."""
    scope = settings.engine.guard_scope
    if scope is None:
        scope = "host" if host_units().cpu else "replica"
    return "host" if scope == "host" and settings.engine.replicas > 1 else None


def build_replicas(
    settings: Settings, runtime_dir: Path, slots: list[CoreSlot] | None = None
) -> list[Replica]:
    """One vLLM engine per embedded replica, then the configured remote replicas.

    Under ``--workers`` (``slots`` given) the engine cores run in the workers' parent,
    whose ``runtime_dir`` holds their sockets, and each engine here attaches to its
    slot; such an engine is not restarted by this process (the parent restarts the
    set)."""
    if not settings.has_local:
        return []  # a provider-only gateway
    model = resolve_model(settings)
    shares = guard_scope(settings)
    if shares:
        log.info(
            "the first-token guard acts across the %d embedded replicas (engine.guard_scope: host)",
            settings.engine.replicas,
        )
    out: list[Replica] = []
    for i, config in enumerate(engine_configs(settings, runtime_dir, model)):
        rid, events = LocationId(f"replica-{i}"), config.kv_events_endpoint
        replay = config.kv_events_replay_endpoint
        if slots is not None:
            engine = VllmEngine(config, slots[i])
            out.append(Replica(rid, engine, events, replay, shares=shares))
            continue
        factory = functools.partial(VllmEngine, config)
        out.append(Replica(rid, factory(), events, replay, factory=factory, shares=shares))
    e = settings.engine
    for i, r in enumerate(settings.remote_replicas):
        remote = RemoteVllmConfig(
            url=r.url,
            tokenizer=model,
            control_secret=r.control_secret.get_secret_value(),
            served_model_name=r.served_model_name,
            api_key=r.api_key.get_secret_value() if r.api_key else None,
            hash_seed=e.hash_seed,
            api=r.api,
        )
        out.append(
            Replica(
                LocationId(f"remote-{i}"),
                RemoteVllmEngine(remote),
                r.kv_events,
                r.kv_events_replay,
                factory=functools.partial(RemoteVllmEngine, remote),
            )
        )
    return out
