"""The Responses API over the session log: conversation state is the log, appended.

``previous_response_id`` names a stored response; its session, folded up to
that response, is the history, and the new input is appended to it (the same
session, so each turn's prefix extends the last and the local engine's
prefix cache keeps hitting).  ``instructions`` are not carried over from the
previous response, as in OpenAI's API.  Answers come from the same chat path
(targets, fallback, caching, verify-before-dispatch).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gateway.core.errors import NotFound, Unavailable
from gateway.core.outputs import Usage
from gateway.core.schemas import ChatCompletionRequest, ChatMessage, RequestModel, StreamOptions
from gateway.core.types import Principal, Served
from gateway.service.chat import GatewayService
from gateway.sessions.log import SessionLog
from gateway.sessions.store import ResponseRow
from manifest.sessionlog import fold, session_name


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["input_text", "output_text", "text"]
    text: str


class InputItem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]

    def text(self) -> str:
        return (
            self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        )


class ResponsesRequest(RequestModel):
    model: str = Field(min_length=1)
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    metadata: dict[str, str] | None = None
    ignore_eos: bool = False  # vLLM extension, as on chat completions
    tools: Any = None

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v: Any) -> Any:
        if v:
            raise ValueError("tools are not supported on /v1/responses by this gateway")
        return v

    def items(self) -> list[InputItem]:
        if isinstance(self.input, str):
            return [InputItem(role="user", content=self.input)]
        return self.input


def _usage(u: Usage | None) -> dict[str, Any] | None:
    if u is None:
        return None
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.prompt_tokens_details.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.total_tokens,
    }


class Responses:
    def __init__(self, svc: GatewayService) -> None:
        self._svc = svc

    @property
    def _log(self) -> SessionLog:
        if self._svc.log is None:
            raise Unavailable("the Responses API needs the session log", code="no_session_log")
        return self._svc.log

    async def _stored(self, response_id: str, who: Principal, param: str | None) -> ResponseRow:
        """The caller's stored, undeleted response (the store is read off the event loop)."""
        row = await asyncio.to_thread(self._log.store.response, response_id)
        if row is None or row.deleted or not row.stored or row.tenant != who.tenant:
            raise NotFound(
                f"Response with id '{response_id}' not found.", param=param, code="not_found"
            )
        return row

    async def _chat_request(
        self, req: ResponsesRequest, who: Principal
    ) -> tuple[ChatCompletionRequest, str | None]:
        messages: list[ChatMessage] = []
        if req.instructions:
            messages.append(ChatMessage(role="system", content=req.instructions))
        session = None
        if req.previous_response_id is not None:
            row = await self._stored(req.previous_response_id, who, "previous_response_id")
            session = session_name(row.session_id)  # the name the chat path scopes again
            events = await asyncio.to_thread(self._log.store.events, row.session_id, row.seq)
            state = fold(e for _, e in events)
            messages += [
                ChatMessage.model_validate({"role": m.role, "content": m.content})
                for m in state.messages
            ]
        messages += [ChatMessage(role=i.role, content=i.text()) for i in req.items()]
        chat = ChatCompletionRequest(
            model=req.model,
            messages=messages,
            max_tokens=req.max_output_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            stream=req.stream,
            stream_options=StreamOptions(include_usage=True) if req.stream else None,
            ignore_eos=req.ignore_eos,
        )
        return chat, session

    def _body(
        self,
        rid: str,
        req: ResponsesRequest,
        text: str,
        finish: str,
        usage: Usage | None,
        status: str,
        created: int,
        msg_id: str,
    ) -> dict[str, Any]:
        done = status != "in_progress"
        incomplete = done and finish == "length"
        item = {
            "type": "message",
            "id": msg_id,
            "status": "incomplete" if incomplete else ("completed" if done else "in_progress"),
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }
        return {
            "id": rid,
            "object": "response",
            "created_at": created,
            "status": "incomplete" if incomplete else status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": req.model,
            "output": [item] if done else [],
            "parallel_tool_calls": True,
            "previous_response_id": req.previous_response_id,
            "store": req.store,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "text": {"format": {"type": "text"}},
            "tool_choice": "auto",
            "tools": [],
            "truncation": "disabled",
            "metadata": req.metadata or {},
            "usage": _usage(usage) if done else None,
        }

    async def _save(self, served: Served, body: dict[str, Any], who: Principal) -> None:
        if served.session is not None and served.answer_seq is not None:
            await asyncio.to_thread(
                self._log.store.add_response,
                body["id"], served.session, served.answer_seq, who.tenant, json.dumps(body),
                body["store"],
            )  # fmt: skip

    async def create(self, req: ResponsesRequest, who: Principal) -> tuple[dict[str, Any], Served]:
        chat, session = await self._chat_request(req, who)
        done = await self._svc.chat(chat, who, None, session)
        c = done.body
        rid = f"resp_{uuid.uuid4().hex}"
        body = self._body(
            rid, req, c.choices[0].message.content or "", c.choices[0].finish_reason, c.usage,
            "completed", int(time.time()), f"msg_{uuid.uuid4().hex}",
        )  # fmt: skip
        await self._save(done.served, body, who)
        return body, done.served

    async def stream(
        self, req: ResponsesRequest, who: Principal
    ) -> tuple[AsyncGenerator[bytes, None], Served]:
        """Server-sent events in the Responses API's types; started (first token) on return."""
        chat, session = await self._chat_request(req, who)
        routed = await self._svc.answer(chat, who, None, session)
        pieces = routed.body.pieces  # errors before the first token surfaced above
        rid, msg_id, created = (
            f"resp_{uuid.uuid4().hex}",
            f"msg_{uuid.uuid4().hex}",
            int(time.time()),
        )
        served = routed.served

        async def events() -> AsyncGenerator[bytes, None]:
            seq = 0

            def ev(kind: str, **data: Any) -> bytes:
                nonlocal seq
                seq += 1
                payload = {"type": kind, "sequence_number": seq - 1, **data}
                return f"event: {kind}\ndata: {json.dumps(payload)}\n\n".encode()

            text: list[str] = []
            finish, usage = "stop", None
            pending = self._body(rid, req, "", "stop", None, "in_progress", created, msg_id)
            yield ev("response.created", response=pending)
            yield ev("response.in_progress", response=pending)
            item = {"type": "message", "id": msg_id, "status": "in_progress", "role": "assistant",
                    "content": []}  # fmt: skip
            yield ev("response.output_item.added", output_index=0, item=item)
            part = {"type": "output_text", "text": "", "annotations": []}
            where = {"item_id": msg_id, "output_index": 0, "content_index": 0}
            yield ev("response.content_part.added", **where, part=part)
            async with aclosing(pieces):
                async for p in pieces:
                    if p.text:
                        text.append(p.text)
                        yield ev("response.output_text.delta", **where, delta=p.text)
                    finish = p.finish_reason or finish
                    usage = p.usage or usage
            full = "".join(text)
            yield ev("response.output_text.done", **where, text=full)
            yield ev("response.content_part.done", **where, part={**part, "text": full})
            body = self._body(rid, req, full, finish, usage, "completed", created, msg_id)
            yield ev("response.output_item.done", output_index=0, item=body["output"][0])
            await self._save(served, body, who)
            kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
            yield ev(kind, response=body)

        return events(), served

    async def get(self, response_id: str, who: Principal) -> dict[str, Any]:
        row = await self._stored(response_id, who, None)
        body: dict[str, Any] = json.loads(row.body)
        return body

    async def delete(self, response_id: str, who: Principal) -> dict[str, Any]:
        await self._stored(response_id, who, None)
        await asyncio.to_thread(self._log.store.delete_response, response_id)
        return {"id": response_id, "object": "response", "deleted": True}
