"""POST /v1/chat/completions, and vLLM's POST /v1/chat/completions/batch"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response

from gateway.core.outputs import ChatCompletion
from gateway.core.schemas import ChatCompletionRequest
from gateway.http.deps import (
    Caller,
    body_value,
    caller,
    json_object,
    session_header,
    validated_body,
    whole,
)
from gateway.http.openapi import GENERATION, streamed
from gateway.http.sse import open_stream
from gateway.service.chat_batch import batch_requests, chat_batch

router = APIRouter(prefix="/v1", tags=["chat"])


@router.post(
    "/chat/completions",
    response_model=None,
    responses={**streamed(ChatCompletion), **GENERATION},
)
async def create_chat_completion(
    body: ChatCompletionRequest,
    call: Annotated[Caller, Depends(caller)],
    session: Annotated[str | None, Depends(session_header)],
) -> Response:
    session = session or body.session_id  # a header wins over vLLM's body field
    if body.stream:
        routed = await call.svc.chat_stream(body, call.who, call.route, session)
        return await open_stream(routed.body, routed.headers())
    done = await call.svc.chat(body, call.who, call.route, session)
    return whole(done.body, done.headers())


async def chat_direct(request: Request) -> Response:
    """:func:`create_chat_completion` served by :mod:`gateway.http.direct`, in FastAPI's
    order: the body read (not JSON: a 400 now), the caller and the session header, then
    the body validated."""
    value = await body_value(request)
    call = await caller(request)
    session = await session_header(request)
    body = validated_body(ChatCompletionRequest, value)
    return await create_chat_completion(body, call, session)


@router.post("/chat/completions/batch", response_model=ChatCompletion, responses=GENERATION)
async def create_batch_chat_completion(
    body: Annotated[dict[str, Any], Depends(json_object)],
    call: Annotated[Caller, Depends(caller)],
) -> Response:
    """Several conversations (``messages``: a list of them), one choice each."""
    done = await chat_batch(call.svc, batch_requests(body), call.who, call.route)
    return whole(done.body, done.headers())
