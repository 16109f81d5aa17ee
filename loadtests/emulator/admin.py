"""The emulator's admin API: inject faults, move the clock, flush caches, read what was received."""

from __future__ import annotations

from dataclasses import asdict
from typing import Literal

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, Field

from .batch_book import BatchRules
from .common import state_of
from .limits import RateLimit, RuleOverride
from .state import Fault

router = APIRouter(prefix="/admin")


class FaultSpec(BaseModel):
    kind: Literal["status", "timeout", "drop", "cut", "garbage"]
    count: int = Field(1, ge=1)
    provider: Literal["anthropic", "openai", "gemini", "deepseek"] | None = None
    status: int = Field(500, ge=400, le=599)
    retry_after: str | None = None
    retry_after_ms: int | None = Field(None, ge=0)
    delay_s: float = Field(30.0, ge=0)
    after_events: int = Field(2, ge=0)


Provider = Literal["anthropic", "openai", "gemini", "deepseek"]


class RulesSpec(BaseModel):
    provider: Provider
    min_prefix: int | None = Field(None, ge=1)
    ttl_s: float | None = Field(None, gt=0)
    ttl_long_s: float | None = Field(None, gt=0)
    granularity: int | None = Field(None, ge=1)


class LimitSpec(BaseModel):
    provider: Provider
    rpm: int = Field(ge=1)
    tpm: int = Field(ge=1)


class BatchRulesSpec(BaseModel):
    delay_s: float = Field(1.0, ge=0)
    parallel: int = Field(16, ge=1)
    wave_s: float = Field(0.0, ge=0)


class Advance(BaseModel):
    seconds: float = Field(ge=0)


@router.post("/faults")
async def add_fault(spec: FaultSpec, request: Request) -> dict[str, int]:
    state = state_of(request)
    state.faults.append(Fault(**spec.model_dump()))
    return {"queued": len(state.faults)}


@router.post("/rules")
async def set_rules(spec: RulesSpec, request: Request) -> dict[str, object]:
    """Cache rules that differ from the documented ones (clients are not told)."""
    rule = RuleOverride(spec.min_prefix, spec.ttl_s, spec.ttl_long_s, spec.granularity)
    state_of(request).rules[spec.provider] = rule
    return {"provider": spec.provider, **asdict(rule)}


@router.post("/limits")
async def set_limits(spec: LimitSpec, request: Request) -> dict[str, object]:
    """Requests and input tokens per minute of emulator time (429 beyond)."""
    state_of(request).limits[spec.provider] = RateLimit(spec.rpm, spec.tpm)
    return spec.model_dump()


@router.post("/batch-rules")
async def set_batch_rules(spec: BatchRulesSpec, request: Request) -> dict[str, object]:
    """How long a batch takes (emulator seconds) and how many of its items run side by
    side (a wave does not read its own cache writes)."""
    state_of(request).batch_book.rules = BatchRules(spec.delay_s, spec.parallel, spec.wave_s)
    return spec.model_dump()


@router.get("/billing")
async def billing(request: Request) -> dict[str, object]:
    """Tokens by price class, requests and 429s, per provider, since the last reset (a
    batch's under ``<provider>-batch``, priced at half the online price)."""
    return {p: b.view() for p, b in state_of(request).bills.items()}


@router.post("/clock/advance")
async def advance(body: Advance, request: Request) -> dict[str, float]:
    state = state_of(request)
    state.clock.advance(body.seconds)
    return {"now": state.clock.now()}


@router.post("/flush")
async def flush(request: Request) -> dict[str, bool]:
    state_of(request).flush()
    return {"flushed": True}


@router.get("/requests")
async def received(request: Request) -> list[dict[str, object]]:
    return [asdict(r) for r in state_of(request).received]


@router.get("/media")
async def media(request: Request) -> list[dict[str, object]]:
    """Every image and document received, in order: the sha256 of its decoded bytes
    (what a test compares with what it sent), media type, size, detail, tokens."""
    return [asdict(m) for m in state_of(request).media]


@router.get("/requests/last")
async def last_body(request: Request) -> Response:
    """The body of the last request received, as it arrived."""
    return Response(state_of(request).last_body, media_type="application/json")


@router.post("/reset")
async def reset(request: Request) -> dict[str, bool]:
    state = state_of(request)
    state.flush()
    state.faults.clear()
    state.received.clear()
    state.media.clear()
    state.rules.clear()
    state.limits.clear()
    state.bills.clear()
    state.batch_book.clear()
    return {"reset": True}
