"""Anchors pinned on the local replicas while their siblings run.

When the runner lets an anchor's siblings go (their lead's answer has begun), it
pins the anchor's prefix through the cache API's pin machinery
(:meth:`CacheService.pin`: the span's blocks held on every replica under a lease
of :class:`~gateway.local.leases.LeaseBook`, owner ``batch:<batch>:<lead>``), so
the blocks the siblings are to read are not evicted under them; it releases the
pin once the last of those siblings has ended (in a ``finally``: a cancelled
walk releases too, and a gateway that dies leaks nothing, its lease runs out).

Only a chat completion's anchor is named here (its prefix is the lead's system
messages and its first turns, rendered as the cache API renders ``messages``); the
other endpoints' anchors, and a model served by hosted providers, are not pinned
(:meth:`CachePins.pin` returns None: counted as skipped).  A pin that fails (the
engines starting, KV tracking off) is skipped the same way: pinning only helps.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.batches.plan import SYSTEM_ROLES
from gateway.core.errors import APIError
from gateway.core.types import Principal
from gateway.service.cache import CacheRequest, CacheService

log = logging.getLogger(__name__)
CHAT = "/v1/chat/completions"


@dataclass(frozen=True)
class Receipt:
    """A pin taken: released with :meth:`AnchorPins.release`."""

    request: CacheRequest
    owner: Principal
    blocks: int  # blocks pinned on all replicas


class AnchorPins(Protocol):
    async def pin(
        self, endpoint: str, body: dict[str, Any], segments: int, owner: Principal, lease_s: float
    ) -> Receipt | None:
        """Pin the first ``segments`` segments of ``body``'s prompt (see
        :func:`gateway.batches.plan.segments`); None when not pinned."""
        ...

    async def release(self, receipt: Receipt) -> None: ...


def prefix_messages(body: dict[str, Any], segments: int) -> list[Any] | None:
    """A chat body's messages of its first ``segments`` segments: the system messages
    (the header) and the first ``segments - 1`` turns; None when that is nothing."""
    messages = body.get("messages")
    if not isinstance(messages, list) or segments < 1:
        return None
    system = [m for m in messages if isinstance(m, dict) and m.get("role") in SYSTEM_ROLES]
    turns = [m for m in messages if not (isinstance(m, dict) and m.get("role") in SYSTEM_ROLES)]
    out = system + turns[: segments - 1]
    return out or None


class CachePins:
    """:class:`AnchorPins` over :class:`CacheService` (see the module)."""

    def __init__(self, cache: CacheService) -> None:
        self._cache = cache

    async def pin(
        self, endpoint: str, body: dict[str, Any], segments: int, owner: Principal, lease_s: float
    ) -> Receipt | None:
        messages = prefix_messages(body, segments) if endpoint == CHAT else None
        if messages is None:
            return None
        try:
            req = CacheRequest.model_validate(
                {"model": body.get("model"), "messages": messages, "lease_s": lease_s}
            )
            res = await self._cache.pin(req, owner)
        except (APIError, ValueError) as exc:  # no local span to pin: skipped
            log.debug("batch anchor not pinned: %s", exc)
            return None
        return Receipt(req, owner, sum(len(r.pinned) for r in res.replicas))

    async def release(self, receipt: Receipt) -> None:
        try:
            await self._cache.unpin(receipt.request, receipt.owner)
        except APIError as exc:  # the lease runs out in any case
            log.warning("batch anchor pin not released: %s", exc)
