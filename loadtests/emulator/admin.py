"""The emulator's admin API: inject faults, move the clock, flush caches, read what was received."""

from __future__ import annotations

from dataclasses import asdict
from typing import Literal

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, Field

from .common import state_of
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


class Advance(BaseModel):
    seconds: float = Field(ge=0)


@router.post("/faults")
async def add_fault(spec: FaultSpec, request: Request) -> dict[str, int]:
    state = state_of(request)
    state.faults.append(Fault(**spec.model_dump()))
    return {"queued": len(state.faults)}


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
    return {"reset": True}
