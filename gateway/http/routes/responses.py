"""POST /v1/responses, GET and DELETE /v1/responses/{id} (see gateway/service/responses_api.py)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response

from gateway.core.errors import APIError
from gateway.core.responses_wire import (
    ErrorEvent,
    ResponseDeleted,
    ResponseObject,
    ResponsesRequest,
)
from gateway.core.types import Principal
from gateway.http.deps import SESSION_ID, body_value, session_header, validated_body, whole
from gateway.http.openapi import GENERATION, errors, streamed
from gateway.http.sse import named_frame, open_stream
from gateway.service.auth import require_principal
from gateway.service.chat import GatewayService
from gateway.service.response_tools import OMITTED_HEADER, response_tools
from gateway.service.responses_api import Responses

router = APIRouter(prefix="/v1", tags=["responses"])


async def responses(request: Request) -> Responses:
    svc: GatewayService = request.app.state.service
    return Responses(svc.answer, svc.chat, svc.log.store if svc.log is not None else None)


Who = Annotated[Principal, Depends(require_principal)]
Api = Annotated[Responses, Depends(responses)]


@router.post(
    "/responses", response_model=None, responses={**streamed(ResponseObject), **GENERATION}
)
async def create_response(
    body: ResponsesRequest,
    who: Who,
    api: Api,
    session: Annotated[str | None, Depends(session_header)],
) -> Response:
    key = body.prompt_cache_key
    if session is None and key is not None and SESSION_ID.match(key):
        session = key  # Codex's thread id: the session, where no header names one
    tools = response_tools(body.all_tools())  # in chat's terms, once
    notes = {OMITTED_HEADER: ", ".join(tools.omitted)} if tools.omitted else {}
    if body.stream:
        events, state, served = await api.stream(body, tools, who, session)

        def failed(exc: APIError) -> bytes:
            ev = ErrorEvent(
                sequence_number=state.n(), code=exc.code, message=exc.message, param=exc.param
            )
            return named_frame(ev)

        headers = {**served.headers(), **notes}
        return await open_stream(events, headers, named_frame, failed, done=None)
    done = await api.create(body, tools, who, session)
    return whole(done.body, {**done.served.headers(), **notes})


async def response_direct(request: Request) -> Response:
    """:func:`create_response` served by :mod:`gateway.http.direct`, in FastAPI's order:
    the body read, the caller, the API, the session header, then the body validated."""
    value = await body_value(request)
    who = await require_principal(request)
    api = await responses(request)
    session = await session_header(request)
    body = validated_body(ResponsesRequest, value)
    return await create_response(body, who, api, session)


@router.get(
    "/responses/{response_id}", response_model=ResponseObject, responses=errors(401, 404, 503)
)
async def get_response(response_id: str, who: Who, api: Api) -> dict[str, Any]:
    return await api.get(response_id, who)


@router.delete(
    "/responses/{response_id}", response_model=ResponseDeleted, responses=errors(401, 404, 503)
)
async def delete_response(response_id: str, who: Who, api: Api) -> ResponseDeleted:
    return await api.delete(response_id, who)
