"""Anthropic's Message Batches API (``/v1/messages/batches``), as the provider serves it.

- ``POST /v1/messages/batches``: ``requests: [{custom_id, params}]``, 1 to 100,000;
  ``custom_id`` 1-64 letters, digits, ``-`` and ``_``, unique in the batch; ``params``
  an object (a Messages request, checked when the item runs: a bad one is that item's
  ``errored`` result).  Errors in Anthropic's shape.
- ``GET /v1/messages/batches/{id}``, ``GET /v1/messages/batches?after_id=&before_id=&limit=``
  (newest first), ``POST /v1/messages/batches/{id}/cancel`` (``canceling``, then
  ``ended`` with the items that never ran ``canceled``), ``DELETE`` of an ended batch.
- ``GET /v1/messages/batches/{id}/results`` once ended (``results_url`` names it; before:
  a 400): JSON lines ``{custom_id, result: {type: succeeded, message} | {type: errored,
  error} | {type: canceled}}`` in the order given.
- ``request_counts``: ``processing``, ``succeeded``, ``errored``, ``canceled``, ``expired``.

Items run as :mod:`.batch_jobs` runs them: their ``cache_control`` breakpoints write and
read the same cache as online requests, best effort inside the batch.
"""

from __future__ import annotations

import json
import re
import time
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from .anthropic import error
from .batch_book import Item, Job
from .batch_jobs import new_id, settle
from .common import check_key, opened, state_of

router = APIRouter()

MAX_REQUESTS = 100_000
CUSTOM_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
WINDOW_S = 86_400


def _auth(request: Request) -> Response | None:
    """``x-api-key``, or a bearer token as the SDK sends its key from 2.x on."""
    bearer = request.headers.get("authorization", "")
    key = request.headers.get("x-api-key") or (bearer[7:] if bearer.startswith("Bearer ") else None)
    if not check_key(state_of(request), key):
        return JSONResponse(error(401, "invalid x-api-key"), 401)
    if not request.headers.get("anthropic-version"):
        return JSONResponse(error(400, "anthropic-version: header is required"), 400)
    return None


def _bad(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse(error(status, message), status)


def _rfc3339(t: int | None) -> str | None:
    return None if t is None else datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


def _items(body: Any) -> list[Item] | str:
    """The batch's items, or why the body is refused."""
    if not isinstance(body, dict):
        return "the request body must be a JSON object"
    reqs = body.get("requests")
    if not isinstance(reqs, list) or not 1 <= len(reqs) <= MAX_REQUESTS:
        return f"requests: between 1 and {MAX_REQUESTS} requests are required"
    items: list[Item] = []
    seen: set[str] = set()
    for n, r in enumerate(reqs):
        if not isinstance(r, dict):
            return f"requests.{n}: Input should be an object"
        cid, params = r.get("custom_id"), r.get("params")
        if not isinstance(cid, str) or not CUSTOM_ID.match(cid):
            return f"requests.{n}.custom_id: String should match pattern '^[a-zA-Z0-9_-]{{1,64}}$'"
        if cid in seen:
            return f"requests.{n}.custom_id: Duplicate custom_id: {cid}"
        if not isinstance(params, dict):
            return f"requests.{n}.params: Field required"
        seen.add(cid)
        items.append(Item(cid, params))
    return items


@router.post("/v1/messages/batches", response_model=None)
async def create(request: Request) -> Response:
    got = await opened(
        request,
        "anthropic",
        "/v1/messages/batches",
        _auth,
        error,
        "the request body is not valid JSON",
    )
    if isinstance(got, Response):
        return got
    state, body = got
    items = _items(body)
    if isinstance(items, str):
        return _bad(items)
    now = int(time.time())
    job = Job(new_id("msgbatch_"), "anthropic", "/v1/messages", items, state.clock.now(), now)
    state.batch_book.jobs[job.id] = job
    return JSONResponse(batch_object(request, job))


def _job(request: Request, batch_id: str) -> Job | Response:
    job = state_of(request).batch_book.jobs.get(batch_id)
    if job is None or job.provider != "anthropic":
        return _bad(f"No message batch found with id '{batch_id}'", 404)
    settle(state_of(request), job)
    return job


@router.get("/v1/messages/batches/{batch_id}", response_model=None)
async def retrieve(batch_id: str, request: Request) -> Response:
    refused = _auth(request)
    if refused is not None:
        return refused
    job = _job(request, batch_id)
    return job if isinstance(job, Response) else JSONResponse(batch_object(request, job))


@router.get("/v1/messages/batches", response_model=None)
async def list_batches(
    request: Request, after_id: str | None = None, before_id: str | None = None, limit: int = 20
) -> Response:
    refused = _auth(request)
    if refused is not None:
        return refused
    if not 1 <= limit <= 1000:
        return _bad("limit: Input should be between 1 and 1000")
    state = state_of(request)
    jobs = [j for j in reversed(state.batch_book.jobs.values()) if j.provider == "anthropic"]
    ids = [j.id for j in jobs]
    if after_id is not None:
        jobs = jobs[ids.index(after_id) + 1 :] if after_id in ids else []
    elif before_id is not None:
        jobs = jobs[: ids.index(before_id)] if before_id in ids else []
    page = jobs[:limit]
    for j in page:
        settle(state, j)
    data = [batch_object(request, j) for j in page]
    return JSONResponse(
        {
            "data": data,
            "has_more": len(jobs) > limit,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
        }
    )


@router.post("/v1/messages/batches/{batch_id}/cancel", response_model=None)
async def cancel(batch_id: str, request: Request) -> Response:
    refused = _auth(request)
    if refused is not None:
        return refused
    job = _job(request, batch_id)
    if isinstance(job, Response):
        return job
    if not job.ended:
        job.state, job.cancel_at = "cancelling", int(time.time())
    return JSONResponse(batch_object(request, job))


@router.delete("/v1/messages/batches/{batch_id}", response_model=None)
async def delete(batch_id: str, request: Request) -> Response:
    refused = _auth(request)
    if refused is not None:
        return refused
    job = _job(request, batch_id)
    if isinstance(job, Response):
        return job
    if not job.ended:
        return _bad("Message batch is still processing: cancel it first")
    del state_of(request).batch_book.jobs[job.id]
    return JSONResponse({"id": job.id, "type": "message_batch_deleted"})


def result_line(item: Item) -> dict[str, Any]:
    if item.status is None:
        return {"custom_id": item.custom_id, "result": {"type": "canceled"}}
    if item.status == 200:
        return {
            "custom_id": item.custom_id,
            "result": {"type": "succeeded", "message": item.answer},
        }
    return {"custom_id": item.custom_id, "result": {"type": "errored", "error": item.answer}}


@router.get("/v1/messages/batches/{batch_id}/results", response_model=None)
async def results(batch_id: str, request: Request) -> Response:
    refused = _auth(request)
    if refused is not None:
        return refused
    job = _job(request, batch_id)
    if isinstance(job, Response):
        return job
    if not job.ended:
        return _bad(f"Message batch {batch_id} has not ended yet: its results are not available")
    data = b"".join(json.dumps(result_line(i)).encode() + b"\n" for i in job.items)
    return Response(data, media_type="application/binary")


def batch_object(request: Request, job: Job) -> dict[str, Any]:
    ran = [i for i in job.items if i.status is not None]
    ok = sum(1 for i in ran if i.status == 200)
    status = {"in_progress": "in_progress", "cancelling": "canceling"}.get(job.state, "ended")
    base = str(request.base_url).rstrip("/")
    return {
        "id": job.id,
        "type": "message_batch",
        "processing_status": status,
        "request_counts": {
            "processing": 0 if job.ended else len(job.items),
            "succeeded": ok,
            "errored": len(ran) - ok,
            "canceled": len(job.items) - len(ran) if job.ended else 0,
            "expired": 0,
        },
        "ended_at": _rfc3339(job.ended_at),
        "created_at": _rfc3339(job.created_at),
        "expires_at": _rfc3339(job.created_at + WINDOW_S),
        "archived_at": None,
        "cancel_initiated_at": _rfc3339(job.cancel_at),
        "results_url": f"{base}/v1/messages/batches/{job.id}/results" if job.ended else None,
    }
