"""POST /v1/chat/completions"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Response

from gateway.core.outputs import ChatCompletion
from gateway.core.schemas import ChatCompletionRequest
from gateway.http.deps import Caller, caller, session_header, whole
from gateway.http.openapi import GENERATION, streamed
from gateway.http.sse import open_stream

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
