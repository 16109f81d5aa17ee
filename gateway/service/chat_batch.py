"""vLLM's ``POST /v1/chat/completions/batch``: several conversations in one request, one
choice each (indexed in order), under the shared sampling fields.

Each conversation is its own chat request through the one service path (its own route,
prediction and session-log entry), all answered at once; the usage is their sum.  As
in vLLM 0.32, a batch is not streamed, takes no tools and one sample per conversation.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import ValidationError

from gateway.core.errors import InvalidRequest, invalid_request_from
from gateway.core.outputs import ChatCompletion, Usage
from gateway.core.schemas import MAX_N, ChatCompletionRequest
from gateway.core.types import Principal, Routed, RouteOverride
from gateway.service.chat import GatewayService

_ONE_AT_A_TIME = {
    "stream": "a batch is answered whole (stream it one conversation at a time)",
    "tools": "tools are not taken by the batch endpoint (as vLLM's)",
    "n": "a batch answers one sample per conversation",
}


def batch_requests(body: dict[str, Any]) -> list[ChatCompletionRequest]:
    """The batch body as one chat request per conversation (a 400 naming what is wrong:
    ``messages[i]...`` for a bad message of conversation i)."""
    convs = body.get("messages")
    if not isinstance(convs, list) or not convs or not all(isinstance(c, list) for c in convs):
        raise InvalidRequest(
            "messages must be a non-empty list of conversations (each a list of messages)",
            param="messages",
            code="invalid_value",
        )
    if len(convs) > MAX_N:
        raise InvalidRequest(
            f"at most {MAX_N} conversations per batch", param="messages", code="invalid_value"
        )
    for name, why in _ONE_AT_A_TIME.items():
        value = body.get(name)
        if (value not in (None, 1)) if name == "n" else bool(value):
            raise InvalidRequest(why, param=name, code="unsupported_parameter")
    out = []
    for i, conv in enumerate(convs):
        try:
            out.append(ChatCompletionRequest.model_validate({**body, "messages": conv}))
        except ValidationError as exc:  # conversation i's messages are messages[i]
            errors = [_in_conversation(dict(e), i) for e in exc.errors()]
            raise invalid_request_from(errors) from exc
    return out


def _in_conversation(error: dict[str, Any], i: int) -> dict[str, Any]:
    loc = tuple(error.get("loc", ()))
    if loc[:1] == ("messages",):
        error["loc"] = ("messages", i, *loc[1:])
    return error


async def chat_batch(
    svc: GatewayService,
    reqs: list[ChatCompletionRequest],
    who: Principal,
    route: RouteOverride | None,
) -> Routed[ChatCompletion]:
    """Every conversation answered at once; one choice each, in order, and the sum of
    their usage (the first one's placement names the response headers)."""
    done = await asyncio.gather(*(svc.chat(r, who, route) for r in reqs))
    choices = []
    prompt = completion = cached = 0
    for i, routed in enumerate(done):
        answer = routed.body
        choices.append(answer.choices[0].model_copy(update={"index": i}))
        u = answer.usage
        prompt += u.prompt_tokens
        completion += u.completion_tokens
        cached += u.prompt_tokens_details.cached_tokens
    first = done[0].body
    usage = Usage.of(prompt, completion, cached)
    body = ChatCompletion(id=first.id, model=first.model, choices=choices, usage=usage)
    return Routed(body, done[0].served)
