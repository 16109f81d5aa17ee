"""POST /v1/responses, GET and DELETE /v1/responses/{id} (see gateway/service/responses.py)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from gateway.core.types import Principal
from gateway.http.openapi import GENERATION, ResponseDeleted, ResponseObject, errors, streamed
from gateway.service.auth import require_principal
from gateway.service.responses import Responses, ResponsesRequest

router = APIRouter(prefix="/v1", tags=["responses"])


async def responses(request: Request) -> Responses:
    return Responses(request.app.state.service)


Who = Annotated[Principal, Depends(require_principal)]
Api = Annotated[Responses, Depends(responses)]


@router.post(
    "/responses", response_model=None, responses={**streamed(ResponseObject), **GENERATION}
)
async def create_response(body: ResponsesRequest, who: Who, api: Api) -> Any:
    if body.stream:
        events, served = await api.stream(body, who)
        return StreamingResponse(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", **served.headers()},
        )
    done, served = await api.create(body, who)
    return JSONResponse(done, headers=served.headers())


@router.get(
    "/responses/{response_id}", response_model=ResponseObject, responses=errors(401, 404, 503)
)
async def get_response(response_id: str, who: Who, api: Api) -> dict[str, Any]:
    return await api.get(response_id, who)


@router.delete(
    "/responses/{response_id}", response_model=ResponseDeleted, responses=errors(401, 404, 503)
)
async def delete_response(response_id: str, who: Who, api: Api) -> dict[str, Any]:
    return await api.delete(response_id, who)
