"""OpenAI's Batch API: ``POST /v1/batches`` (over a ``purpose: batch`` file, see
:mod:`gateway.batches.intake`), ``GET /v1/batches/{id}``, ``GET /v1/batches``
(newest first, ``after`` and ``limit``) and ``POST /v1/batches/{id}/cancel``.  The
items run in the background (:mod:`gateway.batches.runner`); a caller sees its
tenant's batches only (another's is a 404)."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request

from gateway.batches.intake import dry_run, openai_batch, openai_plan
from gateway.batches.runner import BatchRunner
from gateway.batches.targets import BatchTargets
from gateway.batches.wire import BatchList, BatchObject, BatchPlan, batch_object
from gateway.core.errors import NotFound
from gateway.core.types import Principal
from gateway.http.deps import json_object
from gateway.http.openapi import errors
from gateway.http.routes.files import Store
from gateway.service.auth import require_principal

router = APIRouter(prefix="/v1", tags=["batches"])

Who = Annotated[Principal, Depends(require_principal)]


async def batch_runner(request: Request) -> BatchRunner:
    runner: BatchRunner = request.app.state.batch_runner
    return runner


Runner = Annotated[BatchRunner, Depends(batch_runner)]


async def batch_targets(request: Request) -> BatchTargets:
    targets: BatchTargets = request.app.state.batch_targets
    return targets


Targets = Annotated[BatchTargets, Depends(batch_targets)]


def _missing(batch_id: str) -> NotFound:
    return NotFound(f"No such Batch object: {batch_id}", param="batch_id")


@router.post(
    "/batches", response_model=BatchObject | BatchPlan, responses=errors(400, 401, 404, 413)
)
async def create_batch(
    body: Annotated[dict[str, Any], Depends(json_object)],
    who: Who,
    store: Store,
    runner: Runner,
    targets: Targets,
) -> BatchObject | BatchPlan:
    """A batch; with ``"vcache": {"dry_run": true}``, its plan only (nothing made), with
    the provider plan of each hosted target its model resolves to."""
    if dry_run(body):
        plan = await asyncio.to_thread(openai_plan, store, who, body, targets.options)
        return BatchPlan.model_validate(plan)
    row = await asyncio.to_thread(openai_batch, store, who, body)
    runner.wake()
    return batch_object(row)


@router.get("/batches/{batch_id}", response_model=BatchObject, responses=errors(401, 404))
async def get_batch(batch_id: str, who: Who, store: Store) -> BatchObject:
    row = await asyncio.to_thread(store.batch, batch_id, who.tenant, "openai")
    if row is None:
        raise _missing(batch_id)
    return batch_object(row)


@router.get("/batches", response_model=BatchList, responses=errors(400, 401))
async def list_batches(
    who: Who,
    store: Store,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> BatchList:
    rows, more = await asyncio.to_thread(store.page, who.tenant, "openai", limit, after)
    data = [batch_object(r) for r in rows]
    return BatchList(
        data=data,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
        has_more=more,
    )


@router.post("/batches/{batch_id}/cancel", response_model=BatchObject, responses=errors(401, 404))
async def cancel_batch(batch_id: str, who: Who, store: Store, runner: Runner) -> BatchObject:
    row = await asyncio.to_thread(store.cancel, batch_id, who.tenant, "openai")
    if row is None:
        raise _missing(batch_id)
    runner.wake()
    return batch_object(row)
