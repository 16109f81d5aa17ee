"""OpenAI's Files and Batch APIs (``/v1/files``, ``/v1/batches``), as the provider serves them.

- ``POST /v1/files``: multipart ``file`` and ``purpose`` (``batch`` only here: other
  purposes are a 400); ``GET /v1/files/{id}``, ``GET /v1/files/{id}/content``.
- ``POST /v1/batches``: ``input_file_id``, ``endpoint`` (``/v1/chat/completions`` or
  ``/v1/responses``), ``completion_window`` (``24h``), ``metadata`` (at most 16 pairs).
  The input file's lines are checked when the batch is made: a line that is not JSON,
  lacks ``custom_id``, ``method: POST``, ``url`` or ``body``, repeats a ``custom_id``
  or names another endpoint than the batch's makes the batch ``failed`` with
  ``errors.data`` (``code``, ``message``, ``line``), as OpenAI does.
- ``GET /v1/batches/{id}``, ``GET /v1/batches?after=&limit=``, ``POST
  /v1/batches/{id}/cancel`` (``cancelling``, then ``cancelled``; a batch that has
  ended is a 409).
- Once the batch has run (:mod:`.batch_jobs`): ``output_file_id`` (a line per
  answered item: ``{id, custom_id, response: {status_code, request_id, body}, error:
  null}``) and ``error_file_id`` (an item answered with an error status; a cancelled
  batch's items never run: ``response: null, error: {code: batch_cancelled}``).
  ``request_counts`` ``{total, completed, failed}``; ``usage`` sums the items'.
"""

from __future__ import annotations

import json
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from .batch_book import Item, Job, StoredFile
from .batch_jobs import new_id, settle
from .common import check_key, opened, state_of
from .openai import error
from .state import EmulatorState

router = APIRouter()

ENDPOINTS = ("/v1/chat/completions", "/v1/responses")
MAX_LINES = 50_000
WINDOW_S = 86_400


def _auth(request: Request) -> Response | None:
    auth = request.headers.get("authorization", "")
    if not auth.startswith("Bearer ") or not check_key(state_of(request), auth[7:]):
        return JSONResponse(error(401, "Incorrect API key provided"), 401)
    return None


def _bad(message: str, param: str | None = None, status: int = 400) -> JSONResponse:
    body = error(status, message)
    body["error"]["param"] = param
    return JSONResponse(body, status)


def _file_object(f: StoredFile) -> dict[str, Any]:
    return {
        "id": f.id,
        "object": "file",
        "bytes": len(f.data),
        "created_at": f.created_at,
        "filename": f.filename,
        "purpose": f.purpose,
        "status": "processed",
        "expires_at": None,
        "status_details": None,
    }


@router.post("/v1/files", response_model=None)
async def create_file(request: Request) -> Response:
    refused = _auth(request)
    if refused is not None:
        return refused
    state = state_of(request)
    form = await request.form()
    try:
        purpose, upload = form.get("purpose"), form.get("file")
        if purpose != "batch":
            return _bad(
                f"Invalid value for 'purpose': {purpose!r} (this emulator takes 'batch')",
                "purpose",
            )
        if upload is None or isinstance(upload, str):
            return _bad("'file' is a required property", "file")
        data = await upload.read()
        name = upload.filename or "batch.jsonl"
    finally:  # the parts' spooled files, closed now rather than when collected
        await form.close()
    state.log("openai", "/v1/files", data)
    f = StoredFile(new_id("file-"), "batch", name, data, int(time.time()))
    state.batch_book.files[f.id] = f
    return JSONResponse(_file_object(f))


def _file(request: Request, file_id: str) -> StoredFile | Response:
    f = state_of(request).batch_book.files.get(file_id)
    if f is None:
        return _bad(f"No such File object: {file_id}", "id", 404)
    return f


@router.get("/v1/files/{file_id}", response_model=None)
async def get_file(file_id: str, request: Request) -> Response:
    refused = _auth(request)
    if refused is not None:
        return refused
    f = _file(request, file_id)
    return f if isinstance(f, Response) else JSONResponse(_file_object(f))


@router.get("/v1/files/{file_id}/content", response_model=None)
async def file_content(file_id: str, request: Request) -> Response:
    refused = _auth(request)
    if refused is not None:
        return refused
    f = _file(request, file_id)
    return f if isinstance(f, Response) else Response(f.data, media_type="application/octet-stream")


def _lines(data: bytes, endpoint: str) -> tuple[list[Item], list[dict[str, Any]]]:
    """The input file's items, and OpenAI's errors for the lines it refuses."""
    items: list[Item] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()

    def refuse(code: str, message: str, line: int, param: str | None = None) -> None:
        errors.append({"code": code, "message": message, "param": param, "line": line})

    text = data.decode("utf-8", errors="replace")
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        refuse("empty_file", "The batch input file is empty.", 0)
    if len(lines) > MAX_LINES:
        refuse("too_many_requests", f"A batch may hold at most {MAX_LINES} requests.", 0)
    for n, ln in enumerate(lines, start=1):
        try:
            row = json.loads(ln)
        except json.JSONDecodeError:
            refuse("invalid_json_line", "This line is not parseable as valid JSON.", n)
            continue
        if not isinstance(row, dict):
            refuse("invalid_json_line", "This line is not a JSON object.", n)
            continue
        for key in ("custom_id", "method", "url", "body"):
            if key not in row:
                refuse(
                    "missing_required_parameter", f"Missing required parameter: '{key}'.", n, key
                )
                break
        else:
            cid = str(row["custom_id"])
            if row["method"] != "POST":
                refuse("invalid_method", "The method must be 'POST'.", n, "method")
            elif row["url"] != endpoint:
                refuse(
                    "mismatched_endpoint",
                    f"The URL provided for this request does not match the batch endpoint "
                    f"{endpoint}.",
                    n,
                    "url",
                )
            elif cid in seen:
                refuse(
                    "duplicate_custom_id", f"The custom_id {cid!r} is used twice.", n, "custom_id"
                )
            else:
                seen.add(cid)
                items.append(Item(cid, row["body"]))
    return items, errors


@router.post("/v1/batches", response_model=None)
async def create_batch(request: Request) -> Response:
    got = await opened(
        request,
        "openai",
        "/v1/batches",
        _auth,
        error,
        "We could not parse the JSON body of your request.",
    )
    if isinstance(got, Response):
        return got
    state, body = got
    if not isinstance(body, dict):
        return _bad("The body must be a JSON object.")
    endpoint, window = body.get("endpoint"), body.get("completion_window")
    if endpoint not in ENDPOINTS:
        return _bad(f"Invalid value for 'endpoint': {endpoint!r}.", "endpoint")
    if window != "24h":
        return _bad(f"Invalid value for 'completion_window': {window!r}.", "completion_window")
    metadata = body.get("metadata")
    if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > 16):
        return _bad("'metadata' is an object of at most 16 pairs.", "metadata")
    fid = body.get("input_file_id")
    f = state.batch_book.files.get(str(fid))
    if f is None:
        return _bad(f"No such File object: {fid}", "input_file_id", 404)
    items, errors = _lines(f.data, str(endpoint))
    job = Job(
        new_id("batch_"),
        "openai",
        str(endpoint),
        items,
        state.clock.now(),
        int(time.time()),
        input_file_id=f.id,
        metadata=metadata,
    )
    if errors:
        job.state, job.errors, job.ended_at = "failed", errors, int(time.time())
    state.batch_book.jobs[job.id] = job
    return JSONResponse(batch_object(state, job))


def _job(request: Request, batch_id: str) -> Job | Response:
    job = state_of(request).batch_book.jobs.get(batch_id)
    if job is None or job.provider != "openai":
        return _bad(f"No batch found with id '{batch_id}'.", "batch_id", 404)
    settle(state_of(request), job)
    return job


@router.get("/v1/batches/{batch_id}", response_model=None)
async def get_batch(batch_id: str, request: Request) -> Response:
    refused = _auth(request)
    if refused is not None:
        return refused
    job = _job(request, batch_id)
    return job if isinstance(job, Response) else JSONResponse(batch_object(state_of(request), job))


@router.get("/v1/batches", response_model=None)
async def list_batches(request: Request, after: str | None = None, limit: int = 20) -> Response:
    refused = _auth(request)
    if refused is not None:
        return refused
    state = state_of(request)
    if not 1 <= limit <= 100:
        return _bad("'limit' must be between 1 and 100.", "limit")
    jobs = [j for j in reversed(state.batch_book.jobs.values()) if j.provider == "openai"]
    if after is not None:
        ids = [j.id for j in jobs]
        jobs = jobs[ids.index(after) + 1 :] if after in ids else []
    page = jobs[:limit]
    for j in page:
        settle(state, j)
    data = [batch_object(state, j) for j in page]
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": len(jobs) > limit,
        }
    )


@router.post("/v1/batches/{batch_id}/cancel", response_model=None)
async def cancel_batch(batch_id: str, request: Request) -> Response:
    refused = _auth(request)
    if refused is not None:
        return refused
    job = _job(request, batch_id)
    if isinstance(job, Response):
        return job
    if job.ended:
        return _bad(f"Cannot cancel a batch with status '{job.state}'.", None, 409)
    job.state, job.cancel_at = "cancelling", int(time.time())
    return JSONResponse(batch_object(state_of(request), job))


def _output_line(item: Item) -> dict[str, Any]:
    rid = new_id("req_")
    if item.status is None:
        return {
            "id": new_id("batch_req_"),
            "custom_id": item.custom_id,
            "response": None,
            "error": {"code": "batch_cancelled", "message": "The batch was cancelled."},
        }
    return {
        "id": new_id("batch_req_"),
        "custom_id": item.custom_id,
        "response": {"status_code": item.status, "request_id": rid, "body": item.answer},
        "error": None,
    }


def _write_files(state: EmulatorState, job: Job) -> None:
    """The output and error files of a batch that has ended (once)."""
    if job.output_file_id is not None or job.error_file_id is not None or job.state == "failed":
        return
    good = [_output_line(i) for i in job.items if i.status == 200]
    bad = [_output_line(i) for i in job.items if i.status != 200]
    for lines, attr in ((good, "output_file_id"), (bad, "error_file_id")):
        if lines:
            data = b"".join(json.dumps(ln).encode() + b"\n" for ln in lines)
            f = StoredFile(
                new_id("file-"), "batch_output", f"{job.id}_{attr}.jsonl", data, int(time.time())
            )
            state.batch_book.files[f.id] = f
            setattr(job, attr, f.id)


def _usage(job: Job) -> dict[str, Any]:
    inp = cached = out = 0
    for i in job.items:
        u = (i.answer or {}).get("usage") or {}
        inp += int(u.get("prompt_tokens", u.get("input_tokens", 0)) or 0)
        details = u.get("prompt_tokens_details") or u.get("input_tokens_details") or {}
        cached += int(details.get("cached_tokens") or 0)
        out += int(u.get("completion_tokens", u.get("output_tokens", 0)) or 0)
    return {
        "input_tokens": inp,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": out,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": inp + out,
    }


def batch_object(state: EmulatorState, job: Job) -> dict[str, Any]:
    if job.ended:
        _write_files(state, job)
    done = sum(1 for i in job.items if i.status == 200)
    failed = sum(1 for i in job.items if i.status is not None and i.status != 200)
    at = {"completed": "completed_at", "cancelled": "cancelled_at", "failed": "failed_at"}
    out: dict[str, Any] = {
        "id": job.id,
        "object": "batch",
        "endpoint": job.endpoint,
        "errors": {"object": "list", "data": job.errors} if job.errors else None,
        "input_file_id": job.input_file_id,
        "completion_window": "24h",
        "status": job.state,
        "output_file_id": job.output_file_id,
        "error_file_id": job.error_file_id,
        "created_at": job.created_at,
        "in_progress_at": job.created_at if job.state != "failed" else None,
        "expires_at": job.created_at + WINDOW_S,
        "finalizing_at": job.ended_at if job.state == "completed" else None,
        "completed_at": None,
        "failed_at": None,
        "expired_at": None,
        "cancelling_at": job.cancel_at,
        "cancelled_at": None,
        "request_counts": {"total": len(job.items), "completed": done, "failed": failed},
        "metadata": job.metadata,
        "usage": _usage(job),
    }
    if job.state in at:
        out[at[job.state]] = job.ended_at
    return out
