"""Gemini explicit caches (``cachedContents``) for anchors whose reuse pays for them.

An anchor here is the system segment.  Each request for it is counted; once
it has been asked for ``k`` times within one cache TTL, where ``k`` is the
design note's break-even ``k > w / (1 - r)`` under the target's prices, a
cached content is created with that TTL and named by later requests.  A
handle is dropped (and deleted on the provider) when its TTL runs out on the
gateway's clock, on ``delete_all`` at shutdown, or when the provider answers
404 for it.

Planning decides and hands over (:meth:`CachedContents.use` sends nothing):
the creation and the deletion are :data:`CacheAction` values that the
request's send runs once its answer is in, so every request is journaled as
it is sent, and the request that meets the break-even goes inline; the next
names the handle.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from engines.providers.base import ChatCall
from engines.providers.client import ProviderClient
from engines.providers.errors import ProviderError
from engines.providers.gemini import GeminiAdapter
from gateway.providers.book import PromptView
from manifest.economics import dedicated_warm_break_even
from manifest.identity import ContentDigest
from manifest.planner import CapabilityProfile

log = logging.getLogger(__name__)

EXPIRY_MARGIN_S = 60.0  # stop naming a handle this long before the provider drops it


@dataclass(frozen=True)
class Handle:
    name: str
    target: str
    digest: ContentDigest
    tokens: int
    expires: float  # gateway clock


@dataclass(frozen=True)
class CreateCache:
    """Create a cached content for ``call``'s system anchor (the break-even was met)."""

    target: str
    client: ProviderClient = field(repr=False)
    adapter: GeminiAdapter = field(repr=False)
    call: ChatCall = field(repr=False)
    key: tuple[str, ContentDigest]
    seen: int  # requests for the anchor within one TTL


@dataclass(frozen=True)
class DeleteCache:
    """Delete a handle whose TTL ran out on the gateway's clock."""

    client: ProviderClient = field(repr=False)
    handle: Handle


CacheAction = CreateCache | DeleteCache


class CachedContents:
    def __init__(self, clock: Callable[[], float], ttl_s: int = 3600) -> None:
        self._clock = clock
        self.ttl_s = ttl_s
        self._handles: dict[tuple[str, ContentDigest], Handle] = {}
        self._seen: dict[tuple[str, ContentDigest], deque[float]] = {}
        self._creating: set[tuple[str, ContentDigest]] = set()  # being made now
        self.created = 0
        self.deleted = 0
        self.lost_count = 0

    def use(
        self,
        target: str,
        client: ProviderClient,
        profile: CapabilityProfile,
        call: ChatCall,
        view: PromptView,
    ) -> tuple[Handle | None, tuple[CacheAction, ...]]:
        """The handle to name in this request, and what to do once it is answered (a
        handle to create now that the break-even is met, one to delete that expired).
        Decides only: nothing is sent (decide, then hand over)."""
        adapter = client.adapter
        if not isinstance(adapter, GeminiAdapter) or not call.system or call.tools:
            return None, ()  # a request naming a handle may not set tools: none is made
        if "system" not in view.keys:
            return None, ()
        i = view.keys.index("system")
        key = (target, view.digests[i])
        now = self._clock()
        actions: list[CacheAction] = []
        h = self._handles.get(key)
        if h is not None and h.expires <= now:
            self._handles.pop(key, None)
            actions.append(DeleteCache(client, h))
            h = None
        if h is not None:
            return h, tuple(actions)
        seen = self._seen.setdefault(key, deque())
        seen.append(now)
        while seen and seen[0] <= now - self.ttl_s:
            seen.popleft()
        k = dedicated_warm_break_even(profile.write_mult, profile.read_mult)
        if len(seen) >= k and view.tokens[i] >= profile.min_prefix_tokens:
            actions.append(CreateCache(target, client, adapter, call, key, len(seen)))
        return None, tuple(actions)

    async def run(self, actions: tuple[CacheAction, ...]) -> None:
        """What :meth:`use` decided, after the request it was decided for: a failure is
        logged (a cache not made costs a later request its discount, nothing else)."""
        for a in actions:
            if isinstance(a, DeleteCache):
                await self._delete(a.client, a.handle)
            else:
                await self._create(a)

    async def _create(self, a: CreateCache) -> None:
        if a.key in self._creating or a.key in self._handles:
            return  # another request's action made (or is making) it
        self._creating.add(a.key)
        try:
            body = await a.client.send(a.adapter.render_cache(a.call, self.ttl_s))
        except ProviderError as exc:
            log.warning("%s: cached content not created: %s", a.target, exc)
            return
        finally:
            self._creating.discard(a.key)
        now = self._clock()
        tokens = int((body.get("usageMetadata") or {}).get("totalTokenCount") or 0)
        h = Handle(
            str(body["name"]), a.target, a.key[1], tokens, now + self.ttl_s - EXPIRY_MARGIN_S
        )
        self._handles[a.key] = h
        self.created += 1
        log.info("%s: created %s (%d tokens, seen %d times)", a.target, h.name, tokens, a.seen)

    def lost(self, target: str, h: Handle) -> None:
        self._handles.pop((target, h.digest), None)
        self.lost_count += 1

    async def _delete(self, client: ProviderClient, h: Handle) -> None:
        self._handles.pop((h.target, h.digest), None)
        try:
            await client.delete(f"/{h.name}")
            self.deleted += 1
        except ProviderError as exc:
            log.warning("%s: deleting %s failed: %s", h.target, h.name, exc)

    async def evict(self, client: ProviderClient, target: str) -> int:
        """Delete every handle of ``target``; returns how many."""
        doomed = [h for h in self._handles.values() if h.target == target]
        for h in doomed:
            await self._delete(client, h)
        return len(doomed)

    async def delete_all(self, clients: Mapping[str, ProviderClient]) -> None:
        for h in list(self._handles.values()):
            client = clients.get(h.target)
            if client is not None:
                await self._delete(client, h)

    def snapshot(self) -> dict[str, Any]:
        return {
            "live": len(self._handles),
            "created": self.created,
            "deleted": self.deleted,
            "lost": self.lost_count,
        }
