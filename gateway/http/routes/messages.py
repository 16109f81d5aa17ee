"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API).

Auth by ``x-api-key`` or a bearer header against the same keys;
``anthropic-version`` and ``anthropic-beta`` are accepted (and ``?beta=true``,
as coding agents send it).  The conversation's session in the log is named by
``x-vcache-session``, else the agent's own session header
(``X-Claude-Code-Session-Id``), else the session id inside
``metadata.user_id``; failing those the log finds it by prefix.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response

from gateway.core.errors import APIError
from gateway.core.messages_wire import CountTokensRequest, Message, MessagesRequest, TokenCount
from gateway.core.types import Principal, RouteOverride
from gateway.http import anthropic
from gateway.http.deps import (
    SESSION_ID,
    body_value,
    routing_override,
    service,
    session_header,
    validated_body,
)
from gateway.http.openapi import anthropic_errors, streamed
from gateway.http.sse import named_frame, open_stream
from gateway.service.auth import require_anthropic_principal
from gateway.service.limits import anthropic_headers
from gateway.service.messages_api import Messages

router = APIRouter(prefix="/v1", tags=["messages"])

_USER_ID_SESSION = re.compile(r"session_([0-9a-fA-F-]{8,64})")
ERRORS = anthropic_errors(400, 401, 403, 404, 413, 429, 500, 504, 529)


@dataclass(frozen=True)
class MessagesCaller:
    who: Principal
    api: Messages
    route: RouteOverride | None
    request_id: str


async def messages_caller(request: Request) -> MessagesCaller:
    rid = anthropic.request_id(request)
    who = await require_anthropic_principal(request)
    svc = await service(request)
    return MessagesCaller(who, Messages(svc), routing_override(request, who, svc), rid)


def metadata_session(user_id: str | None) -> str | None:
    """The session id a coding agent puts in ``metadata.user_id``: a JSON object with a
    ``session_id``, or the older ``user_<hash>_account_<uuid>_session_<uuid>`` text."""
    if not user_id:
        return None
    try:
        value = json.loads(user_id)
    except ValueError:
        value = None
    if isinstance(value, dict) and isinstance(value.get("session_id"), str):
        sid: str = value["session_id"]
        return sid if SESSION_ID.match(sid) else None
    found = _USER_ID_SESSION.search(user_id)
    return found.group(1) if found else None


async def conversation(request: Request, body: MessagesRequest) -> str | None:
    """A header's session (a bad x-vcache-session is a 400), else ``metadata.user_id``'s."""
    named = await session_header(request)
    if named is not None:
        return named
    return metadata_session(body.metadata.user_id if body.metadata else None)


Caller = Annotated[MessagesCaller, Depends(messages_caller)]


@router.post(
    "/messages",
    response_model=None,
    responses={**streamed(Message), **ERRORS},
    summary="Create a Message (Anthropic's Messages API)",
)
async def create_message(body: MessagesRequest, call: Caller, request: Request) -> Response:
    session = await conversation(request, body)
    extra = {"request-id": call.request_id}
    if body.stream:
        routed = await call.api.stream(body, call.who, call.route, session)

        def failed(exc: APIError) -> bytes:
            _, event = anthropic.error_event(exc, call.request_id)
            return named_frame(event)

        return await open_stream(
            routed.body,
            {**anthropic_headers(routed.headers()), **extra},
            named_frame,
            failed,
            done=None,
        )
    done = await call.api.create(body, call.who, call.route, session)
    headers = {**anthropic_headers(done.headers()), **extra}
    return Response(done.body.model_dump_json(), media_type="application/json", headers=headers)


async def message_direct(request: Request) -> Response:
    """:func:`create_message` served by :mod:`gateway.http.direct`, in FastAPI's order: the
    body read, the caller, then the body validated."""
    value = await body_value(request)
    call = await messages_caller(request)
    body = validated_body(MessagesRequest, value)
    return await create_message(body, call, request)


@router.post(
    "/messages/count_tokens",
    response_model=TokenCount,
    responses=anthropic_errors(400, 401, 404, 529),
    summary="Count the tokens of a Messages request as the local model renders it",
)
async def count_tokens(body: CountTokensRequest, call: Caller, response: Response) -> TokenCount:
    response.headers["request-id"] = call.request_id
    return await call.api.count_tokens(body)
