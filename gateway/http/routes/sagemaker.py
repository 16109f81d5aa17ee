"""The SageMaker hosting routes vLLM's server offers: ``/ping`` (the health check) and
``POST /invocations``, which answers a chat request (``messages``) as
``/v1/chat/completions`` and a text request (``prompt``) as ``/v1/completions``, by the
body's shape, through the same handlers."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from gateway.core.completion_request import CompletionRequest
from gateway.core.errors import InvalidRequest
from gateway.core.schemas import ChatCompletionRequest
from gateway.http.deps import Caller, caller, json_object, service, session_header
from gateway.http.openapi import GENERATION
from gateway.http.routes.chat import create_chat_completion
from gateway.http.routes.completions import create_completion
from gateway.service.chat import GatewayService

router = APIRouter(tags=["sagemaker"])


class PingStatus(BaseModel):
    status: Literal["ok", "unavailable"]


_NOT_READY: dict[int | str, dict[str, Any]] = {
    503: {"model": PingStatus, "description": "Not ready to serve a request"}
}


# one route per method: OpenAPI gives each its own operation id
@router.get("/ping", response_model=PingStatus, responses=_NOT_READY)
@router.post("/ping", response_model=PingStatus, responses=_NOT_READY)
async def ping(svc: Annotated[GatewayService, Depends(service)]) -> JSONResponse:
    """200 when a request can be served now, 503 otherwise (as /readyz)."""
    ok = svc.ready
    return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)


@router.post("/invocations", response_model=None, responses=GENERATION)
async def invocations(
    body: Annotated[dict[str, Any], Depends(json_object)],
    call: Annotated[Caller, Depends(caller)],
    session: Annotated[str | None, Depends(session_header)],
) -> Response:
    try:
        if "messages" in body:
            chat = ChatCompletionRequest.model_validate(body)
            return await create_chat_completion(chat, call, session)
        if "prompt" in body:
            return await create_completion(CompletionRequest.model_validate(body), call)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from exc
    raise InvalidRequest(
        "an invocation is a chat request (messages) or a text completion (prompt)",
        param="messages",
        code="invalid_value",
    )
