"""OpenAI's Files API, as far as batches use it: ``POST /v1/files`` (multipart, purpose
``batch``: JSON lines checked as they arrive, a bad line a 400 naming it),
``GET /v1/files/{id}`` and ``GET /v1/files/{id}/content`` (a batch's input, output or
error file).  A caller sees its tenant's files only (another's is a 404)."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response
from starlette.datastructures import UploadFile

from gateway.batches.intake import input_lines
from gateway.batches.store import BatchStore
from gateway.batches.wire import FileObject, file_object
from gateway.core.errors import InvalidRequest, NotFound
from gateway.core.types import Principal
from gateway.http.openapi import errors
from gateway.service.auth import require_principal

router = APIRouter(prefix="/v1", tags=["files"])

Who = Annotated[Principal, Depends(require_principal)]


async def batch_store(request: Request) -> BatchStore:
    store: BatchStore = request.app.state.batches
    return store


Store = Annotated[BatchStore, Depends(batch_store)]


def _missing(file_id: str) -> NotFound:
    return NotFound(f"No such File object: {file_id}", param="file_id")


@router.post("/files", response_model=FileObject, responses=errors(400, 401, 413))
async def create_file(request: Request, who: Who, store: Store) -> FileObject:
    try:
        form = await request.form()
    except Exception as exc:  # starlette's multipart parser: a body that is not a form
        raise InvalidRequest(
            f"the body must be multipart/form-data with 'file' and 'purpose': {exc}",
            code="invalid_value",
        ) from exc
    try:
        purpose, upload = form.get("purpose"), form.get("file")
        if purpose != "batch":
            raise InvalidRequest(
                f"'purpose' must be 'batch' (got {purpose!r}): this gateway keeps batch files only",
                param="purpose",
                code="invalid_value",
            )
        if not isinstance(upload, UploadFile):
            raise InvalidRequest("'file' must be a file part", param="file", code="invalid_value")
        data = await upload.read()
        name = upload.filename or "batch.jsonl"
    finally:  # the parts' spooled files (on disk past 1 MB): closed now, not when collected
        await form.close()
    await asyncio.to_thread(input_lines, data)  # a bad line is a 400 naming it
    row = await asyncio.to_thread(store.add_file, who.tenant, "batch", name, data)
    return file_object(row)


@router.get("/files/{file_id}", response_model=FileObject, responses=errors(401, 404))
async def get_file(file_id: str, who: Who, store: Store) -> FileObject:
    row = await asyncio.to_thread(store.file, who.tenant, file_id)
    if row is None:
        raise _missing(file_id)
    return file_object(row)


@router.get("/files/{file_id}/content", responses=errors(401, 404))
async def get_file_content(file_id: str, who: Who, store: Store) -> Response:
    data = await asyncio.to_thread(store.file_content, who.tenant, file_id)
    if data is None:
        raise _missing(file_id)
    return Response(data, media_type="application/jsonl")
