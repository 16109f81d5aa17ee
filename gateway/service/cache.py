"""Cache operations over the local replicas' exact KV spans, shared by HTTP and gRPC.

Spans are named by a prompt (``messages``, ``prompt`` or ``token_ids``,
rendered and hashed exactly as a request would be) or by explicit
``block_hashes`` (hex).  They belong to the caller's tenant unless a global
admin names another ``tenant``: the tenant is part of every block hash.  A ``model``
that names a LoRA adapter names that adapter's spans (its blocks are keyed by it):
a pin under it also keeps the adapter on the replica while the pin's lease lasts
(a full replica lets another adapter go to load one, never a leased one).  An
admin key's scope is its own tenant; raw block hashes, which can name any
tenant's span, need a global admin key (``scope: global``).

A warm on the local replicas is a request like any other (a chat's messages,
or a text prompt: one token generated, discarded), through the service loop:
admitted, journaled in the session log, routed over the serving replicas, through
the replica's fair gate (:meth:`GatewayService.warm_local`).
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Awaitable, Callable

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engines.lora import LoraRef
from gateway.core.completion_request import CompletionRequest, TextPrompt
from gateway.core.config import LOCAL_TARGET
from gateway.core.errors import (
    InvalidRequest,
    NotFound,
    PermissionDenied,
    Unavailable,
    maps_engine_errors,
)
from gateway.core.outputs import Usage
from gateway.core.schemas import ChatCompletionRequest, ChatMessage, RequestModel, TokenId
from gateway.core.target import Call
from gateway.core.types import Principal, RouteOverride, Served, tenant_salt
from gateway.local.spans import KVSpans
from gateway.providers import control_plan
from gateway.service.attachment_intake import AttachmentIntake
from gateway.service.local import LocalChat
from gateway.service.provider_chat import ProviderChat
from gateway.service.targets import Targets
from manifest.hashing import BlockHash, MMSpan, from_hex
from manifest.index import LocationId


class CacheRequest(RequestModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    prompt: str | None = Field(None, min_length=1)
    token_ids: list[TokenId] | None = Field(None, min_length=1)
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


class ReplicaPins(BaseModel):
    replica: str
    pinned: list[str]
    missing: list[str]
    refused: list[str]


class PinResponse(BaseModel):
    owner: str
    lease_s: float
    replicas: list[ReplicaPins]


class ReplicaUnpins(BaseModel):
    replica: str
    unpinned: list[str]


class UnpinResponse(BaseModel):
    replicas: list[ReplicaUnpins]


class ReplicaEvictions(BaseModel):
    replica: str
    evicted: list[str]
    busy: list[str]


class EvictResponse(BaseModel):
    replicas: list[ReplicaEvictions]


class WarmResponse(BaseModel):
    replica: str
    cached_tokens_before: int
    cached_tokens_after: int


class ProviderWarmResponse(BaseModel):
    """A provider warm: what its telemetry said (Anthropic writes with ``max_tokens: 0``;
    implicit providers are warmed by a normal request)."""

    target: str
    prompt_tokens: int
    cached_tokens: int
    written_tokens: int


def check_scope(body: CacheRequest, who: Principal) -> None:
    """An admin acts on its own tenant's spans; only a global admin on another's."""
    if body.tenant is not None and body.tenant != who.tenant and not who.global_admin:
        raise PermissionDenied(
            "Only a global admin key may name another tenant", code="global_admin_required"
        )
    if body.block_hashes and not who.global_admin:
        # A raw hash can name any tenant's span: only a global admin may use them.
        raise PermissionDenied(
            "block_hashes need a global admin key (scope: global); name the span by "
            "messages, prompt or token_ids instead",
            code="global_admin_required",
        )


# a provider warm: (request, tenant, target, request id) to the usage it reported
WarmProvider = Callable[[ChatCompletionRequest, str, str, str], Awaitable[Usage]]
# a local warm: its call to where it went, its usage and the prompt's token ids
WarmLocal = Callable[[Call], Awaitable[tuple[Served, Usage, tuple[int, ...]]]]


class _Spans:
    """A cache request resolved to tokens (when given), block hashes (under the adapter
    ``model`` names, if it names one) and replicas."""

    def __init__(
        self,
        body: CacheRequest,
        who: Principal,
        tokens: list[int] | None,
        kv: KVSpans,
        lora: LoraRef | None = None,
        mm: tuple[MMSpan, ...] = (),
    ):
        self.salt = tenant_salt(body.tenant or who.tenant)
        self.tokens = tokens
        self.lora = lora
        self.hashes: list[BlockHash]
        if self.tokens is not None:
            self.hashes = kv.hashes(self.tokens, self.salt, lora, mm)
        else:
            try:
                self.hashes = [from_hex(h) for h in body.block_hashes or []]
            except ValueError as exc:
                raise InvalidRequest(str(exc), param="block_hashes", code="invalid_value") from exc
        if body.replica is None:
            self.replicas = kv.replicas
        elif body.replica in kv.replicas:
            self.replicas = [LocationId(body.replica)]
        else:
            raise NotFound(
                f"Unknown replica '{body.replica}'", param="replica", code="replica_not_found"
            )


class CacheService:
    """The admin operations; callers check that the principal is an admin.  Spans are
    the local model's (``local``, served as ``model``); a model whose targets are hosted
    providers names their caches (``providers``, warmed through ``warm_provider``).
    ``intake`` takes in a prompt's images for a local vision-language model (its spans
    are keyed by them, as a chat's)."""

    def __init__(
        self,
        local: LocalChat,
        model: str,
        targets: Targets,
        providers: ProviderChat | None,
        warm_provider: WarmProvider,
        warm_local: WarmLocal,
        intake: AttachmentIntake,
    ) -> None:
        self._local = local
        self._intake = intake
        self._model = model
        self._targets = targets
        self._providers = providers
        self._warm_provider = warm_provider
        self._warm_local = warm_local

    @property
    def _kv(self) -> KVSpans | None:
        """The local replicas' span manager, once they are up (the supervisor sets it)."""
        return self._local.dispatcher.kv

    def _manager(self) -> KVSpans:
        if self._kv is None:
            raise Unavailable(
                "Exact KV tracking is not available (engines starting, or KV events disabled)",
                code="kv_tracking_unavailable",
                retry_after_s=5,
            )
        return self._kv

    async def _spans(self, body: CacheRequest, who: Principal) -> tuple[KVSpans, _Spans]:
        check_scope(body, who)
        local = self._local
        local.check_model(body.model, self._model)
        kv = self._manager()
        tokens: list[int] | None = None
        mm: tuple[MMSpan, ...] = ()
        if body.messages:
            chat = self._image_chat(body)
            if chat is None:
                tokens = await local.chat_tokens(body.messages)
            else:
                tokens, mm = await self._image_prompt(chat)
        elif body.prompt:
            tokens = await local.text_tokens(body.prompt, add_special_tokens=True)  # as completions
        elif body.token_ids:
            tokens = local.check_token_ids(list(body.token_ids), "token_ids")
        return kv, _Spans(body, who, tokens, kv, local.adapter(body.model), mm)

    def _image_chat(self, body: CacheRequest) -> ChatCompletionRequest | None:
        """``body.messages`` as the chat request they render as, when they carry images for
        a local vision-language model (None: text only, or a model that reads text only,
        which refuses them by name)."""
        if not body.messages or not self._local.sees:
            return None
        chat = ChatCompletionRequest(model=body.model, messages=body.messages)
        return chat if any(chat.attachment_parts()) else None

    async def _image_prompt(
        self, chat: ChatCompletionRequest
    ) -> tuple[list[int], tuple[MMSpan, ...]]:
        """``chat``'s images taken in (a bad one is a 400 naming its part), its token ids with
        each image expanded as vLLM expands it, and the images' spans."""
        await self._intake.take(chat)
        return await self._local.chat_prompt(chat)

    @staticmethod
    def require_admin(who: Principal) -> None:
        if not who.admin:
            raise PermissionDenied(
                "The cache API needs an admin key: configure one with 'admin: true' in "
                "api_keys and send it as 'Authorization: Bearer KEY'",
                code="admin_required",
            )

    @maps_engine_errors
    async def lookup(self, body: CacheRequest, who: Principal) -> LookupResponse:
        kv, spans = await self._spans(body, who)
        await kv.sync(barrier=True)
        n = len(spans.tokens) if spans.tokens is not None else len(spans.hashes) * kv.block_size + 1
        predicted = kv.predict(spans.hashes, n)
        matched = kv.index.match(spans.hashes)
        return LookupResponse(
            model=body.model,
            prompt_tokens=len(spans.tokens) if spans.tokens is not None else 0,
            block_size=kv.block_size,
            replicas=[
                ReplicaSpans(
                    replica=r,
                    predicted_cached_tokens=predicted[r],
                    exact=kv.is_exact(r),
                    block_hashes=[h.hex() for h in spans.hashes],
                    resident=[i < matched[r] for i in range(len(spans.hashes))],
                    pinned=[kv.index.is_pinned(r, h) for h in spans.hashes],
                )
                for r in spans.replicas
            ],
        )

    @maps_engine_errors
    async def pin(self, body: CacheRequest, who: Principal) -> PinResponse:
        kv, spans = await self._spans(body, who)
        await kv.sync(barrier=True)
        owner = who.key_name or who.tenant
        results = [await kv.pin(r, spans.hashes, owner, body.lease_s) for r in spans.replicas]
        adapters = self._local.adapters
        if spans.lora is not None and adapters is not None:  # not let go while pinned
            for p in results:
                if p.pinned:
                    lease = body.lease_s or kv.default_lease_s
                    adapters.lease(p.replica, spans.lora.name, owner, lease)
        return PinResponse(
            owner=owner,
            lease_s=body.lease_s or kv.default_lease_s,
            replicas=[
                ReplicaPins(
                    replica=p.replica, pinned=p.pinned, missing=p.missing, refused=p.refused
                )
                for p in results
            ],
        )

    @maps_engine_errors
    async def unpin(self, body: CacheRequest, who: Principal) -> UnpinResponse:
        kv, spans = await self._spans(body, who)
        owner = who.key_name or who.tenant
        adapters = self._local.adapters
        if spans.lora is not None and adapters is not None:
            for r in spans.replicas:
                adapters.unlease(r, spans.lora.name, owner)
        return UnpinResponse(
            replicas=[
                ReplicaUnpins(replica=r, unpinned=await kv.unpin(r, spans.hashes, owner))
                for r in spans.replicas
            ]
        )

    def _provider_target(self, body: CacheRequest) -> str | None:
        """The first provider target of ``body.model`` when it names no local target (an
        adapter of the local model, not shadowed by an alias, names the local one)."""
        if body.model not in self._targets.names() and self._local.adapter(body.model):
            return None
        targets = self._targets.resolve(body.model)
        if LOCAL_TARGET in targets or self._providers is None:
            return None
        return targets[0]

    @maps_engine_errors
    async def evict(self, body: CacheRequest, who: Principal) -> EvictResponse:
        target = self._provider_target(body)
        if target is not None:  # Gemini cached contents; other providers cannot be told
            assert self._providers is not None
            path = self._providers.path
            t = path.target(target)
            n = await path.cached_contents.evict(t.client, target)
            return EvictResponse(
                replicas=[ReplicaEvictions(replica=target, evicted=[str(n)], busy=[])]
            )
        kv, spans = await self._spans(body, who)
        out = []
        for r in spans.replicas:
            evicted, busy = await kv.evict(r, spans.hashes)
            out.append(ReplicaEvictions(replica=r, evicted=evicted, busy=busy))
        return EvictResponse(replicas=out)

    @maps_engine_errors
    async def warm_provider(
        self, body: CacheRequest, who: Principal
    ) -> ProviderWarmResponse | None:
        target = self._provider_target(body)
        if target is None:
            return None
        if not body.messages:
            raise InvalidRequest(
                "a provider warm needs messages", param="messages", code="invalid_value"
            )
        req = ChatCompletionRequest(model=body.model, messages=body.messages)
        rid = f"warm-{uuid.uuid4().hex}"
        u = await self._warm_provider(req, body.tenant or who.tenant, target, rid)
        return ProviderWarmResponse(
            target=target,
            prompt_tokens=u.prompt_tokens,
            cached_tokens=u.prompt_tokens_details.cached_tokens,
            written_tokens=u.prompt_tokens_details.cache_write_tokens or 0,
        )

    @maps_engine_errors
    async def warm(self, body: CacheRequest, who: Principal) -> WarmResponse:
        """Prefill the prompt where the next request for it would go (the router's choice
        over the serving replicas), or on ``replica`` when it serves; a request through
        the loop (see the module).  The tokens it found cached (the engine's count) and
        those resident after (the exact index, synced to the engine)."""
        check_scope(body, who)
        self._local.check_model(body.model, self._model)
        kv = self._manager()
        if body.block_hashes:
            raise InvalidRequest(
                "warm needs a prompt (messages, prompt or token_ids), not block hashes",
                param="block_hashes",
                code="invalid_value",
            )
        route = None
        if body.replica is not None:
            route = RouteOverride(replica=self._serving(body.replica))
        await kv.sync(barrier=True)  # the index and the engines agree (503 when one cannot say)
        tenant = body.tenant or who.tenant
        call = Call(
            self._warm_request(body),
            dataclasses.replace(who, tenant=tenant),
            f"warm-{uuid.uuid4().hex}",
            route=route,
            warm=True,
        )
        mm: tuple[MMSpan, ...] = ()
        chat = self._image_chat(body)
        if chat is not None:  # its images' spans (the warm renders the same prompt)
            _, mm = await self._image_prompt(chat)
        served, usage, ids = await self._warm_local(call)
        if served.dispatch is None:  # an answer is routed before it is sent
            raise RuntimeError(f"{call.request_id}: answered without a replica")
        replica = LocationId(served.dispatch.replica_id)
        await kv.sync(barrier=True)  # the blocks it stored are in the index
        salt = tenant_salt(tenant)
        lora = self._local.adapter(body.model)  # an adapter's warm: its own blocks
        after = kv.predict(kv.hashes(ids, salt, lora, mm), len(ids) + 1).get(replica, 0)
        before = usage.prompt_tokens_details.cached_tokens
        return WarmResponse(replica=replica, cached_tokens_before=before, cached_tokens_after=after)

    def _serving(self, replica: str) -> str:
        """``replica``, named for a warm: known (else a 404) and serving (else a 503: a
        dead replica is never warmed)."""
        d = self._local.dispatcher
        r = d.replica(replica)
        if r is None:
            raise NotFound(
                f"Unknown replica '{replica}'", param="replica", code="replica_not_found"
            )
        if not r.engine.ready:
            raise Unavailable(
                f"replica '{replica}' is not serving; it is being restarted",
                code="engine_unavailable",
                retry_after_s=d.replica_set.retry_after_s(),
            )
        return replica

    @staticmethod
    def _warm_request(body: CacheRequest) -> ChatCompletionRequest | TextPrompt:
        """What a warm asks of the local model: its messages as a chat, or its prompt (as
        text completions tokenize it) or token ids; one token, greedy."""
        if body.messages:
            return ChatCompletionRequest(
                model=body.model, messages=body.messages, max_tokens=1, temperature=0.0
            )
        if body.prompt:
            req = CompletionRequest(
                model=body.model, prompt=body.prompt, max_tokens=1, temperature=0.0
            )
            return TextPrompt(req, body.prompt)
        ids = list(body.token_ids or [])
        req = CompletionRequest(model=body.model, prompt=ids, max_tokens=1, temperature=0.0)
        return TextPrompt(req, ids, "token_ids")

    @maps_engine_errors
    async def stats(self) -> dict[str, object]:
        """The local replicas' KV accounting and, with providers, each provider target's
        hit rate, writes, reads, verified savings and false-warm count."""
        providers = self._providers
        out: dict[str, object] = {}
        if self._kv is not None or providers is None:
            out.update(await self._manager().stats())
        if providers is not None:
            out["providers"] = providers.path.stats()
        return out

    def plan(self) -> dict[str, object]:
        """The control loop's view of the observed provider traffic (``/v1/cache/plan``)."""
        providers = self._providers
        control = providers.path.control if providers is not None else None
        if control is None:
            return {"mode": "off", "targets": {}, "note": "no hosted provider is configured"}
        return control_plan.plan(control)
