"""Anthropic's Message Batches API: ``POST /v1/messages/batches`` (``requests: [{custom_id,
params}]``, see :mod:`gateway.batches.intake`), ``GET /v1/messages/batches/{id}``,
``GET /v1/messages/batches`` (newest first, ``after_id``, ``before_id``, ``limit``),
``POST /v1/messages/batches/{id}/cancel``, ``GET /v1/messages/batches/{id}/results``
(JSON lines ``{custom_id, result: {type: succeeded | errored | canceled | expired}}``,
once the batch has ended) and ``DELETE /v1/messages/batches/{id}`` (an ended batch).

Errors are Anthropic's (the routes live under ``/v1/messages``, see
:mod:`gateway.http.anthropic`), each response carries a ``request-id``; a caller sees
its tenant's batches only (another's is a 404)."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Response

from gateway.batches.intake import anthropic_batch, anthropic_plan, dry_run
from gateway.batches.store import BatchRow, BatchStore, ItemRow
from gateway.batches.wire import (
    BatchPlan,
    DeletedMessageBatch,
    MessageBatchList,
    MessageBatchObject,
    message_batch_object,
)
from gateway.core.errors import APIError, InvalidRequest, NotFound
from gateway.core.types import Principal
from gateway.http import anthropic
from gateway.http.deps import json_object
from gateway.http.openapi import anthropic_errors
from gateway.http.routes.batches import Runner, Targets
from gateway.http.routes.files import Store
from gateway.service.auth import require_anthropic_principal

router = APIRouter(prefix="/v1/messages", tags=["message batches"])

Who = Annotated[Principal, Depends(require_anthropic_principal)]
ERRORS = anthropic_errors(400, 401, 404, 413)


async def request_id(request: Request, response: Response) -> str:
    rid = anthropic.request_id(request)
    response.headers["request-id"] = rid
    return rid


RequestId = Annotated[str, Depends(request_id)]


def _missing(batch_id: str) -> NotFound:
    return NotFound(f"No such message batch: {batch_id}", param="message_batch_id")


def _object(request: Request, row: BatchRow) -> MessageBatchObject:
    url = f"{str(request.base_url).rstrip('/')}/v1/messages/batches/{row.id}/results"
    return message_batch_object(row, url)


async def _batch(store: BatchStore, batch_id: str, who: Principal) -> BatchRow:
    row: BatchRow | None = await asyncio.to_thread(store.batch, batch_id, who.tenant, "anthropic")
    if row is None:
        raise _missing(batch_id)
    return row


@router.post("/batches", response_model=MessageBatchObject | BatchPlan, responses=ERRORS)
async def create_message_batch(
    request: Request,
    body: Annotated[dict[str, Any], Depends(json_object)],
    who: Who,
    store: Store,
    runner: Runner,
    targets: Targets,
    _: RequestId,
) -> MessageBatchObject | BatchPlan:
    """A batch; with ``"vcache": {"dry_run": true}``, its plan only (nothing made), with
    the provider plan of each hosted target its model resolves to."""
    if dry_run(body):
        plan = await asyncio.to_thread(anthropic_plan, body, targets.options)
        return BatchPlan.model_validate(plan)
    row = await asyncio.to_thread(anthropic_batch, store, who, body)
    runner.wake()
    return _object(request, row)


@router.get("/batches/{batch_id}", response_model=MessageBatchObject, responses=ERRORS)
async def get_message_batch(
    request: Request, batch_id: str, who: Who, store: Store, _: RequestId
) -> MessageBatchObject:
    return _object(request, await _batch(store, batch_id, who))


@router.get("/batches", response_model=MessageBatchList, responses=ERRORS)
async def list_message_batches(
    request: Request,
    who: Who,
    store: Store,
    _: RequestId,
    after_id: str | None = None,
    before_id: str | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 20,
) -> MessageBatchList:
    rows, more = await asyncio.to_thread(
        store.page, who.tenant, "anthropic", limit, after_id, before_id
    )
    data = [_object(request, r) for r in rows]
    return MessageBatchList(
        data=data,
        has_more=more,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
    )


@router.post("/batches/{batch_id}/cancel", response_model=MessageBatchObject, responses=ERRORS)
async def cancel_message_batch(
    request: Request, batch_id: str, who: Who, store: Store, runner: Runner, _: RequestId
) -> MessageBatchObject:
    row = await asyncio.to_thread(store.cancel, batch_id, who.tenant, "anthropic")
    if row is None:
        raise _missing(batch_id)
    runner.wake()
    return _object(request, row)


@router.delete("/batches/{batch_id}", response_model=DeletedMessageBatch, responses=ERRORS)
async def delete_message_batch(
    batch_id: str, who: Who, store: Store, _: RequestId
) -> DeletedMessageBatch:
    row = await _batch(store, batch_id, who)
    if not row.ended:
        raise InvalidRequest(
            f"Message batch {batch_id} has not ended: cancel it, then delete it once it has",
            code="invalid_value",
        )
    await asyncio.to_thread(store.delete, batch_id, who.tenant, "anthropic")
    return DeletedMessageBatch(id=batch_id)


def result_line(item: ItemRow) -> dict[str, Any]:
    """One item's line of the results file, in Anthropic's shape."""
    result: dict[str, Any]
    if item.state == "done":
        result = {"type": "succeeded", "message": (item.result or {}).get("body")}
    elif item.state == "error":
        e = (item.result or {}).get("error") or {}
        exc = APIError(str(e.get("message", "")))
        exc.status = int(e.get("status") or item.status_code or 500)
        _, event = anthropic.error_event(exc, (item.result or {}).get("request_id"))
        result = {"type": "errored", "error": event.model_dump(exclude_none=True)}
    else:  # canceled, expired
        result = {"type": item.state}
    line: dict[str, Any] = {"custom_id": item.custom_id, "result": result}
    if "cost" in (item.result or {}):  # vcache's own: billed and in arrival order
        line["vcache"] = {"cost": (item.result or {})["cost"]}
    return line


@router.get("/batches/{batch_id}/results", responses=ERRORS)
async def message_batch_results(batch_id: str, who: Who, store: Store, rid: RequestId) -> Response:
    row = await _batch(store, batch_id, who)
    if not row.ended:
        raise InvalidRequest(
            f"Message batch {batch_id} has not ended yet: its results are not available",
            code="invalid_value",
        )
    items = await asyncio.to_thread(store.items, batch_id)
    text = "".join(json.dumps(result_line(i), separators=(",", ":")) + "\n" for i in items)
    return Response(text, media_type="application/binary", headers={"request-id": rid})
