"""POST /v1/completions"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response

from gateway.core.completion_request import CompletionRequest
from gateway.core.outputs import Completion
from gateway.http.deps import Caller, body_value, caller, validated_body, whole
from gateway.http.openapi import GENERATION, streamed
from gateway.http.sse import open_stream

router = APIRouter(prefix="/v1", tags=["completions"])


@router.post("/completions", response_model=None, responses={**streamed(Completion), **GENERATION})
async def create_completion(
    body: CompletionRequest, call: Annotated[Caller, Depends(caller)]
) -> Response:
    if body.stream:
        routed = await call.svc.complete_stream(body, call.who, call.route)
        return await open_stream(routed.body, routed.headers())
    done = await call.svc.complete(body, call.who, call.route)
    return whole(done.body, done.headers())


async def completion_direct(request: Request) -> Response:
    """:func:`create_completion` served by :mod:`gateway.http.direct`, in FastAPI's order:
    the body read, the caller, then the body validated."""
    value = await body_value(request)
    call = await caller(request)
    body = validated_body(CompletionRequest, value)
    return await create_completion(body, call)
