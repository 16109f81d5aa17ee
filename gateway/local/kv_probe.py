"""The hash probe: a prefill on a replica for the span manager, at its start.

The probe prefills a prompt under a salt of its own and waits for its
``BlockStored`` events: their hashes must equal the manifest's
(:func:`manifest.hashing.block_hashes`), or the replica is *approximate* and
its predictions are not reported as exact.  It is the one request the gateway
sends a model outside the service loop (not in the session log: a fixed text,
its blocks evicted after).  A client's warm (``/v1/cache/warm``) is a request
through the loop (:meth:`gateway.service.cache.CacheService.warm`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from engines.base import GenerateRequest, SamplingOptions
from gateway.local.kv_sync import Agreement, CoreControlled, KVSync
from manifest.hashing import BlockHash
from manifest.index import LocationId

log = logging.getLogger(__name__)


async def prefill(engine: CoreControlled, tokens: Sequence[int], salt: str | None, tag: str) -> int:
    """Prefill ``tokens`` (one token generated, discarded); the tokens that were cached."""
    req = GenerateRequest(
        request_id=f"{tag}-{time.monotonic_ns()}",
        prompt_token_ids=tuple(tokens),
        sampling=SamplingOptions(max_tokens=1, temperature=0.0),
        cache_salt=salt,
    )
    cached = 0
    async for chunk in engine.generate(req):
        if chunk.num_cached_tokens is not None:
            cached = chunk.num_cached_tokens
    return cached


async def probe(
    kv: KVSync,
    replica: LocationId,
    tokens: Sequence[int],
    expected: Sequence[BlockHash],
    salt: str,
    clock: Callable[[], float],
    timeout_s: float = 10.0,
) -> Agreement:
    """Prefill the probe prompt (hashed as ``expected`` under ``salt``) and compare the
    blocks the engine reports with ours; the probe's blocks are evicted after."""
    st = kv.state(replica)
    await prefill(st.engine, tokens, salt, "probe")
    deadline = clock() + timeout_s
    want = len(expected)
    while True:
        await kv.barrier(st)
        got = kv.index.match(expected)[replica]
        if got == want or clock() > deadline:
            break
        await asyncio.sleep(0.05)
    st.agreement = "exact" if got == want and want > 0 else "approximate"
    if st.agreement == "approximate":
        log.warning(
            "replica %s: block hashes disagree with the manifest (%d/%d blocks): "
            "predictions are approximate",
            replica,
            got,
            want,
        )
    await st.control.evict(expected)
    return st.agreement
