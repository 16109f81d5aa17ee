"""Build the configured engine: the demo model when no model is configured."""

from __future__ import annotations

import logging

from engines.vllm.demo_model import ensure_demo_model
from engines.vllm.engine import VllmEngine, VllmEngineConfig
from gateway.config import Settings

log = logging.getLogger(__name__)


def resolve_model(settings: Settings) -> str:
    """A local path or hub id; builds (once) and returns the demo model if none is set."""
    if settings.model:
        return settings.model
    path = ensure_demo_model(settings.data_dir)
    log.info("no model configured: serving the demo model (random weights) from %s", path)
    return str(path)


def build_vllm_engine(settings: Settings) -> VllmEngine:
    e = settings.engine
    return VllmEngine(
        VllmEngineConfig(
            model=resolve_model(settings),
            served_name=settings.model_name,
            max_model_len=e.max_model_len,
            block_size=e.block_size,
            kv_cache_bytes=e.kv_cache_bytes,
            gpu_memory_utilization=e.gpu_memory_utilization,
            enforce_eager=e.enforce_eager,
            hash_seed=e.hash_seed,
            # The gateway admits a request first; vLLM's own queue is the backstop.
            max_queued_requests=e.max_queued_requests + 16,
            tensor_parallel_size=e.tensor_parallel_size,
            dtype=e.dtype,
        )
    )
