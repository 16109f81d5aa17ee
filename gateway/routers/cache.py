"""Admin API over the exact KV spans of the local replicas: /v1/cache/*.

Spans are named by a prompt (``messages``, ``prompt`` or ``token_ids``,
rendered and hashed exactly as a request would be) or by explicit
``block_hashes`` (hex).  They belong to the caller's tenant unless an admin
names another ``tenant``: the tenant is part of every block hash.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from gateway.auth import require_principal
from gateway.errors import InvalidRequest, NotFound, PermissionDenied, Unavailable
from gateway.kvcache import KVCacheManager
from gateway.routers.chat import service
from gateway.schemas import ChatMessage
from gateway.service import GatewayService, Principal, tenant_salt
from manifest.hashing import from_hex
from manifest.index import LocationId

router = APIRouter(prefix="/v1/cache", tags=["cache"])


def require_admin(who: Annotated[Principal, Depends(require_principal)]) -> Principal:
    if not who.admin:
        raise PermissionDenied("The cache API needs an admin key", code="admin_required")
    return who


def kv_manager(request: Request) -> KVCacheManager:
    kv: KVCacheManager | None = request.app.state.kv
    if kv is None:
        raise Unavailable(
            "Exact KV tracking is not available (engines starting, or KV events disabled)",
            code="kv_tracking_unavailable",
            retry_after_s=5,
        )
    return kv


class CacheRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    prompt: str | None = Field(None, min_length=1)
    token_ids: list[int] | None = Field(None, min_length=1)
    block_hashes: list[str] | None = Field(None, min_length=1)
    replica: str | None = None
    tenant: str | None = None
    lease_s: float | None = Field(None, gt=0, le=86400)

    @model_validator(mode="after")
    def _one_source(self) -> CacheRequest:
        given = [n for n in ("messages", "prompt", "token_ids", "block_hashes") if getattr(self, n)]
        if len(given) != 1:
            raise ValueError("give exactly one of messages, prompt, token_ids, block_hashes")
        return self


class ReplicaSpans(BaseModel):
    replica: str
    predicted_cached_tokens: int
    exact: bool
    block_hashes: list[str]
    resident: list[bool]
    pinned: list[bool]


class LookupResponse(BaseModel):
    model: str
    prompt_tokens: int
    block_size: int
    replicas: list[ReplicaSpans]


class _Spans:
    """A request resolved to tokens (when given) and block hashes."""

    def __init__(self, body: CacheRequest, who: Principal, svc: GatewayService, kv: KVCacheManager):
        svc.check_model(body.model)
        if body.tenant is not None and body.tenant != who.tenant and not who.admin:
            raise PermissionDenied("Only an admin may name another tenant", code="admin_required")
        self.salt = tenant_salt(body.tenant or who.tenant)
        self.tokens: list[int] | None = None
        if body.messages:
            self.tokens = svc.chat_tokens(body.messages)
        elif body.prompt:
            self.tokens = svc.text_tokens(body.prompt)
        elif body.token_ids:
            self.tokens = list(body.token_ids)
        if self.tokens is not None:
            self.hashes = kv.hashes(self.tokens, self.salt)
        else:
            try:
                self.hashes = [from_hex(h) for h in body.block_hashes or []]
            except ValueError as exc:
                raise InvalidRequest(str(exc), param="block_hashes", code="invalid_value") from exc
        self.replicas = _replicas(body.replica, kv)


def _replicas(name: str | None, kv: KVCacheManager) -> list[LocationId]:
    if name is None:
        return kv.replicas
    if name not in kv.replicas:
        raise NotFound(f"Unknown replica '{name}'", param="replica", code="replica_not_found")
    return [LocationId(name)]


Admin = Annotated[Principal, Depends(require_admin)]
Svc = Annotated[GatewayService, Depends(service)]


@router.post("/lookup")
async def lookup(body: CacheRequest, who: Admin, svc: Svc, request: Request) -> LookupResponse:
    kv = kv_manager(request)  # after the body validated: a bad request is a 400 first
    spans = _Spans(body, who, svc, kv)
    await kv.sync(barrier=True)
    n = len(spans.tokens) if spans.tokens is not None else len(spans.hashes) * kv.block_size + 1
    predicted = kv.predict(spans.hashes, n)
    out = []
    for r in spans.replicas:
        resident = kv.index.match(spans.hashes)[r]
        out.append(
            ReplicaSpans(
                replica=r,
                predicted_cached_tokens=predicted[r],
                exact=kv.is_exact(r),
                block_hashes=[h.hex() for h in spans.hashes],
                resident=[i < resident for i in range(len(spans.hashes))],
                pinned=[kv.index.is_pinned(r, h) for h in spans.hashes],
            )
        )
    return LookupResponse(
        model=body.model,
        prompt_tokens=len(spans.tokens) if spans.tokens is not None else 0,
        block_size=kv.block_size,
        replicas=out,
    )


@router.post("/pin")
async def pin(body: CacheRequest, who: Admin, svc: Svc, request: Request) -> dict[str, Any]:
    kv = kv_manager(request)  # after the body validated: a bad request is a 400 first
    spans = _Spans(body, who, svc, kv)
    await kv.sync(barrier=True)
    owner = who.key_name or who.tenant
    results = [await kv.pin(r, spans.hashes, owner, body.lease_s) for r in spans.replicas]
    return {
        "owner": owner,
        "lease_s": body.lease_s or kv.default_lease_s,
        "replicas": [
            {"replica": p.replica, "pinned": p.pinned, "missing": p.missing, "refused": p.refused}
            for p in results
        ],
    }


@router.post("/unpin")
async def unpin(body: CacheRequest, who: Admin, svc: Svc, request: Request) -> dict[str, Any]:
    kv = kv_manager(request)  # after the body validated: a bad request is a 400 first
    spans = _Spans(body, who, svc, kv)
    owner = who.key_name or who.tenant
    return {
        "replicas": [
            {"replica": r, "unpinned": await kv.unpin(r, spans.hashes, owner)}
            for r in spans.replicas
        ]
    }


@router.post("/evict")
async def evict(body: CacheRequest, who: Admin, svc: Svc, request: Request) -> dict[str, Any]:
    kv = kv_manager(request)  # after the body validated: a bad request is a 400 first
    spans = _Spans(body, who, svc, kv)
    out = []
    for r in spans.replicas:
        evicted, busy = await kv.evict(r, spans.hashes)
        out.append({"replica": r, "evicted": evicted, "busy": busy})
    return {"replicas": out}


@router.post("/warm")
async def warm(body: CacheRequest, who: Admin, svc: Svc, request: Request) -> dict[str, Any]:
    kv = kv_manager(request)  # after the body validated: a bad request is a 400 first
    spans = _Spans(body, who, svc, kv)
    if spans.tokens is None:
        raise InvalidRequest(
            "warm needs a prompt (messages, prompt or token_ids), not block hashes",
            param="block_hashes",
            code="invalid_value",
        )
    await kv.sync(barrier=True)
    if body.replica is None:  # where the next request for this prompt would go
        predicted = kv.predict(spans.hashes, len(spans.tokens))
        replicas = svc.dispatcher.replicas
        target = svc.dispatcher.router.choose(replicas, predicted).id
    else:
        target = spans.replicas[0]
    before, after = await kv.warm(target, spans.tokens, spans.salt)
    return {"replica": target, "cached_tokens_before": before, "cached_tokens_after": after}


@router.get("/stats")
async def stats(who: Admin, request: Request) -> dict[str, Any]:
    kv = kv_manager(request)
    return await kv.stats()
