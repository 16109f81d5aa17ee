"""One batch item sent through the service path every request takes.

:class:`ServiceSender` validates an item's body as the endpoint's route would (a body
that is not a valid request is the item's 400, in the endpoint's error shape) and
calls the same service method (:meth:`GatewayService.chat`, ``complete``, the
Responses and Messages APIs' ``create``), so every item is admitted, journaled in
the session log and rebuildable like any request.  The caller is the batch's
tenant and key at the ``batch`` priority, the lowest: interactive and default
requests go first (admission keeps room for them; vLLM schedules them ahead).

An item other items wait for (a lead, see :mod:`gateway.batches.runner`) is sent with
a ``started`` event: a chat completion, or a Responses request's chat, then goes
through the streaming path (:meth:`GatewayService.answer`, whose first piece is
produced when it returns), so the event is set at its first token and its siblings
need not wait for its end; it is shaped into the same whole object.  Every other
item, and a lead of the completions or Messages endpoints, is answered whole (the
engine's coalesced outputs; its fallback until the end) and ``started`` is left to
the runner, which sets it at the end.

What comes back is an :class:`Outcome`: the answer's body and usage, or the error as
the gateway would have answered it (a refusal for load is ``retryable``: the runner
sends the item again after the ``Retry-After``); nothing here raises but a
cancellation.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import BaseModel, ValidationError

from gateway.batches.store import BatchUsage
from gateway.core.completion_request import CompletionRequest
from gateway.core.errors import APIError, invalid_request_from
from gateway.core.messages_wire import MessagesRequest
from gateway.core.outputs import ChatCompletion
from gateway.core.responses_wire import ResponsesRequest
from gateway.core.schemas import ChatCompletionRequest
from gateway.core.shaping import chat_completion
from gateway.core.types import Principal, Routed
from gateway.service.chat import GatewayService, chat_shape
from gateway.service.messages_api import Messages
from gateway.service.response_tools import response_tools
from gateway.service.responses_api import Responses

log = logging.getLogger(__name__)

CHAT, COMPLETIONS, RESPONSES, MESSAGES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
)
OPENAI_ENDPOINTS = (CHAT, COMPLETIONS, RESPONSES)
RETRYABLE = (429, 503)


@dataclass(frozen=True)
class Outcome:
    """An item's answer (``body``) or its error (``error``: status, type, code, param,
    message), with its usage (``input`` includes ``cached``)."""

    status_code: int
    request_id: str
    body: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    usage: BatchUsage = field(default_factory=BatchUsage)
    retry_after_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def retryable(self) -> bool:
        """Refused for load (the queue full, a rate limit, an engine starting): the
        item is sent again later rather than failed."""
        return self.status_code in RETRYABLE

    def result(self) -> dict[str, Any]:
        """What the store keeps of it."""
        out: dict[str, Any] = {"request_id": self.request_id}
        if self.body is not None:
            out["body"] = self.body
        if self.error is not None:
            out["error"] = self.error
        return out


def batch_caller(tenant: str, key_name: str) -> Principal:
    """The principal a batch's items run as: its creator's tenant and key, lowest priority."""
    return Principal(tenant=tenant, key_name=key_name, priority="batch")


def error_of(exc: APIError) -> dict[str, Any]:
    return {
        "status": exc.status,
        "type": exc.type,
        "code": exc.code,
        "param": exc.param,
        "message": exc.message,
    }


def usage_of(body: dict[str, Any]) -> BatchUsage:
    """The usage an answer body reports, in any of the four APIs' terms."""
    u = body.get("usage") or {}
    if "prompt_tokens" in u:  # chat, completions
        details = u.get("prompt_tokens_details") or {}
        return BatchUsage(
            int(u["prompt_tokens"]),
            int(details.get("cached_tokens") or 0),
            int(u.get("completion_tokens") or 0),
        )
    if "input_tokens_details" in u:  # Responses
        cached = int((u.get("input_tokens_details") or {}).get("cached_tokens") or 0)
        return BatchUsage(int(u["input_tokens"]), cached, int(u.get("output_tokens") or 0))
    if "input_tokens" in u:  # Anthropic: input excludes the cache's reads and writes
        read = int(u.get("cache_read_input_tokens") or 0)
        written = int(u.get("cache_creation_input_tokens") or 0)
        return BatchUsage(
            int(u["input_tokens"]) + read + written, read, int(u.get("output_tokens") or 0)
        )
    return BatchUsage()


class Sender(Protocol):
    async def __call__(
        self,
        endpoint: str,
        body: dict[str, Any],
        who: Principal,
        started: asyncio.Event | None = None,
    ) -> Outcome:
        """Send one item; ``started`` (where given) is set once its answer has begun."""
        ...


class ServiceSender:
    """Items through :class:`GatewayService` (see the module)."""

    def __init__(self, svc: GatewayService) -> None:
        self._svc = svc

    async def _chat(
        self,
        chat: ChatCompletionRequest,
        who: Principal,
        started: asyncio.Event,
        session: str | None = None,
    ) -> Routed[ChatCompletion]:
        """A chat answered through the streaming path (its first piece produced when
        :meth:`GatewayService.answer` returns: ``started`` is set then), shaped whole."""
        req = self._svc.named(chat)
        routed = await self._svc.answer(req, who, None, session)
        started.set()
        a = routed.body
        async with aclosing(a.pieces) as pieces:  # cancelled: the engine request aborts
            body = await chat_completion(a.id, req.model, pieces, chat_shape(req))
        return Routed(body, routed.served)

    async def _answer(
        self, endpoint: str, body: dict[str, Any], who: Principal, started: asyncio.Event | None
    ) -> BaseModel:
        svc = self._svc
        if endpoint == CHAT:
            chat = ChatCompletionRequest.model_validate({**body, "stream": False})
            if started is not None:
                return (await self._chat(chat, who, started)).body
            return (await svc.chat(chat, who)).body
        if endpoint == COMPLETIONS:
            text = CompletionRequest.model_validate({**body, "stream": False})
            return (await svc.complete(text, who)).body
        if endpoint == RESPONSES:
            req = ResponsesRequest.model_validate({**body, "stream": False})
            store = svc.log.store if svc.log is not None else None
            if started is not None:  # a lead: its chat through the streaming path

                async def chat_lead(
                    chat: ChatCompletionRequest, who: Principal, _: None, session: str | None
                ) -> Routed[ChatCompletion]:
                    return await self._chat(chat, who, started, session)

                api = Responses(svc.answer, chat_lead, store)
            else:
                api = Responses(svc.answer, svc.chat, store)
            return (await api.create(req, response_tools(req.all_tools()), who, None)).body
        if endpoint == MESSAGES:
            msg = MessagesRequest.model_validate({**body, "stream": False})
            return (await Messages(svc).create(msg, who, None, None)).body
        raise ValueError(f"not a batch endpoint: {endpoint}")

    async def __call__(
        self,
        endpoint: str,
        body: dict[str, Any],
        who: Principal,
        started: asyncio.Event | None = None,
    ) -> Outcome:
        rid = f"req_{uuid.uuid4().hex[:24]}"
        try:
            answer = await self._answer(endpoint, body, who, started)
        except ValidationError as exc:
            err = invalid_request_from(exc.errors())
            return Outcome(err.status, rid, error=error_of(err))
        except APIError as exc:
            return Outcome(exc.status, rid, error=error_of(exc), retry_after_s=exc.retry_after_s)
        except Exception:  # a bug of ours: the item fails, the batch goes on
            log.exception("batch item %s on %s failed", rid, endpoint)
            bug = APIError("The server had an error processing your request")
            return Outcome(bug.status, rid, error=error_of(bug))
        out = answer.model_dump(mode="json")  # as the route serializes it
        return Outcome(200, rid, body=out, usage=usage_of(out))
