"""Admin API over the local replicas' exact KV spans: /v1/cache/* (see gateway/service/cache.py)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request

from gateway.core.types import Principal
from gateway.http.openapi import COMMON, errors
from gateway.service.auth import require_principal
from gateway.service.cache import (
    CacheRequest,
    CacheService,
    EvictResponse,
    LookupResponse,
    PinResponse,
    ProviderWarmResponse,
    UnpinResponse,
    WarmResponse,
)

router = APIRouter(prefix="/v1/cache", tags=["cache"])
CACHE_ERRORS = errors(*COMMON, 403, 404, 502)


async def require_admin(who: Annotated[Principal, Depends(require_principal)]) -> Principal:
    CacheService.require_admin(who)
    return who


async def cache_service(request: Request) -> CacheService:
    cache: CacheService = request.app.state.cache
    return cache


Admin = Annotated[Principal, Depends(require_admin)]
Cache = Annotated[CacheService, Depends(cache_service)]


@router.post("/lookup", responses=CACHE_ERRORS)
async def lookup(body: CacheRequest, who: Admin, cache: Cache) -> LookupResponse:
    return await cache.lookup(body, who)


@router.post("/pin", responses=CACHE_ERRORS)
async def pin(body: CacheRequest, who: Admin, cache: Cache) -> PinResponse:
    return await cache.pin(body, who)


@router.post("/unpin", responses=CACHE_ERRORS)
async def unpin(body: CacheRequest, who: Admin, cache: Cache) -> UnpinResponse:
    return await cache.unpin(body, who)


@router.post("/evict", responses=CACHE_ERRORS)
async def evict(body: CacheRequest, who: Admin, cache: Cache) -> EvictResponse:
    return await cache.evict(body, who)


@router.post("/warm", responses=CACHE_ERRORS)
async def warm(body: CacheRequest, who: Admin, cache: Cache) -> WarmResponse | ProviderWarmResponse:
    """Local replicas: prefill the prompt's blocks.  A provider-only model: warm its anchors."""
    provider = await cache.warm_provider(body, who)
    if provider is not None:
        return provider
    return await cache.warm(body, who)


@router.get("/stats", responses=errors(401, 403, 503))
async def stats(who: Admin, cache: Cache) -> dict[str, object]:
    return await cache.stats()


@router.get("/plan", responses=errors(401, 403))
async def plan(who: Admin, cache: Cache) -> dict[str, object]:
    """The observed provider traffic's economics: per target the Zipf skew of anchor
    popularity, top-N coverage, the warm set the rate-limit headroom sustains, the
    break-even reuse of a dedicated warm per TTL tier, and each anchor's decision."""
    return cache.plan()
