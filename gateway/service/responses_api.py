"""The Responses API over the session log: conversation state is the log, appended.

``previous_response_id`` names a stored response; its session, folded up to
that response, is the history (tool calls and tool results included), and the
new input is appended to it (the same session, so each turn's prefix extends
the last and the local engine's prefix cache keeps hitting).
``instructions`` are not carried over from the previous response, as in
OpenAI's API.  Input items map onto chat turns: messages as they are, an
assistant's ``function_call`` items onto its tool calls (``call_id`` is the
chat call id), ``function_call_output`` items onto tool results; tools,
``tool_choice`` and ``text.format`` onto their chat counterparts.  An
``input_image`` (in a message or a call's output) becomes an ``image_url`` part
with its ``detail``, an ``input_file`` a ``file`` part, where they sit, so the
one intake reads them as it reads chat's.  Answers come from the same chat
path (targets, fallback, caching, verify-before-dispatch).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Any

from pydantic import ValidationError

from gateway.core.errors import APIError, InvalidRequest, NotFound, Unavailable
from gateway.core.outputs import ChatCompletion
from gateway.core.pieces import Answer
from gateway.core.responses_wire import (
    ContentPart,
    CustomToolCallItem,
    CustomToolCallOutputItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputFile,
    InputImage,
    Item,
    MessageItem,
    ResponseDeleted,
    ResponseObject,
    ResponsesRequest,
    ResponseState,
    StreamEvent,
)
from gateway.core.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    EdgeHints,
    FileData,
    FilePart,
    FunctionCallIn,
    ImageUrl,
    ImageUrlPart,
    TextPart,
    ToolCallIn,
)
from gateway.core.types import Principal, Routed, Served
from gateway.service.part_names import chat_names, client_named
from gateway.service.response_answers import (
    ResponseStream,
    new_id,
    output_items,
    response_object,
)
from gateway.service.response_tools import (
    ResponseTools,
    chat_name,
    chat_tool_choice,
    custom_arguments,
)
from gateway.sessions.store import ResponseRow, SessionStore
from manifest.attachments import Attachment, AttachmentRef, data_url
from manifest.sessionlog import MessageEvent, PartRef, fold, parts_of, session_name

Ask = Callable[[ChatCompletionRequest, Principal, None, str | None], Awaitable[Routed[Any]]]


def chat_content(
    parts: str | Sequence[ContentPart | InputImage | InputFile],
) -> str | list[TextPart | ImageUrlPart | FilePart]:
    """A message's content or a call's output in chat's terms: text alone as a string, else
    its parts in order, each image an ``image_url`` part and each file a ``file`` part."""
    if isinstance(parts, str):
        return parts
    if all(isinstance(p, ContentPart) for p in parts):
        return "".join(p.text for p in parts if isinstance(p, ContentPart))
    out: list[TextPart | ImageUrlPart | FilePart] = []
    for p in parts:
        if isinstance(p, ContentPart):
            out.append(TextPart(type="text", text=p.text))
        elif isinstance(p, InputImage):
            image = ImageUrl(url=p.image_url or "", detail=p.detail)
            out.append(ImageUrlPart(type="image_url", image_url=image, uuid=p.uuid))
        else:
            file = FileData(file_data=p.file_data, filename=p.filename)
            out.append(FilePart(type="file", file=file))
    return out


def chat_turns(items: Sequence[Item], tools: ResponseTools) -> list[ChatMessage]:
    """Input items as chat turns: a run of call items is one assistant turn's tool calls
    (the text message just before them, if the assistant's, is that turn's); reasoning
    items are not shown to the model (see :mod:`gateway.service.response_tools`)."""
    return named_turns(items, tools)[0]


def _names(where: str, parts: str | Sequence[Any]) -> list[str]:
    return [] if isinstance(parts, str) else [f"{where}[{j}]" for j in range(len(parts))]


def named_turns(
    items: Sequence[Item], tools: ResponseTools
) -> tuple[list[ChatMessage], dict[int, list[str]]]:
    """:func:`chat_turns`, with the client's name of each part of each turn that has
    parts, by turn (``input[3].content[1]``: see
    :func:`~gateway.service.part_names.client_named`)."""
    out: list[ChatMessage] = []
    names: dict[int, list[str]] = {}
    for k, item in enumerate(items):
        if isinstance(item, MessageItem):
            names[len(out)] = _names(f"input[{k}].content", item.content)
            out.append(ChatMessage(role=item.role, content=chat_content(item.content)))
        elif isinstance(item, FunctionCallItem | CustomToolCallItem):
            if isinstance(item, FunctionCallItem):
                args = item.arguments
            else:
                args = custom_arguments(item.input)
            fn = FunctionCallIn(name=chat_name(item.name, item.namespace), arguments=args)
            call = ToolCallIn(id=item.call_id, function=fn)
            last = out[-1] if out else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                out.append(ChatMessage(role="assistant", content="", tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputItem | CustomToolCallOutputItem):
            content = chat_content(item.output)
            names[len(out)] = _names(f"input[{k}].output", item.output)
            out.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=content))
    return out, names


def _logged_part(
    p: str | PartRef, attachments: Callable[[AttachmentRef], Attachment]
) -> TextPart | ImageUrlPart | FilePart:
    """A logged part with its object's bytes (verified by the store), taken in already."""
    if isinstance(p, str):
        return TextPart(type="text", text=p)
    att = attachments(p.ref)
    url = data_url(p.ref.media_type, att.data)
    part: ImageUrlPart | FilePart
    if p.ref.kind == "image":
        image = ImageUrl(url=url, detail=p.detail)
        part = ImageUrlPart(type="image_url", image_url=image, uuid=p.uuid)
    else:
        part = FilePart(type="file", file=FileData(file_data=url, filename=p.title))
    part.with_attachment(att)
    return part


def logged_turn(m: MessageEvent, attachments: Callable[[AttachmentRef], Attachment]) -> ChatMessage:
    """A turn of the log as the chat request it was part of (its images and documents
    from the attachments store, ``attachments``, verified: a missing or corrupt object
    fails naming its digest)."""
    parts = parts_of(m)
    content: Any = [_logged_part(p, attachments) for p in parts] if parts else m.content
    msg = ChatMessage.model_validate(
        {
            "role": m.role,
            "content": content,
            "name": m.name,
            "tool_calls": json.loads(m.tool_calls) if m.tool_calls else None,
            "tool_call_id": m.tool_call_id,
        }
    )
    if m.thinking:
        msg.with_thinking(json.loads(m.thinking))
    if m.tool_changes:
        msg.with_tool_changes(json.loads(m.tool_changes))
    return msg


def chat_fields(req: ResponsesRequest, tools: ResponseTools) -> dict[str, Any]:
    """Tools, tool choice and text format in chat's terms."""
    out: dict[str, Any] = {}
    if tools.chat:
        out["tools"] = list(tools.chat)
    choice = chat_tool_choice(req, tools)
    if choice is not None:
        out["tool_choice"] = choice
    if req.parallel_tool_calls is not None and tools.chat:
        out["parallel_tool_calls"] = req.parallel_tool_calls
    fmt = req.text_format()
    if fmt.type == "json_object":
        out["response_format"] = {"type": "json_object"}
    elif fmt.type == "json_schema":
        spec = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}
        if fmt.description is not None:
            spec["description"] = fmt.description
        out["response_format"] = {"type": "json_schema", "json_schema": spec}
    return out


def edge_hints(req: ResponsesRequest, tools: ResponseTools) -> EdgeHints:
    """What the log keeps beyond chat's fields: the hosted tools left out, the effort."""
    effort = req.reasoning.effort if req.reasoning is not None else None
    return EdgeHints(omitted_tools=tools.omitted, effort=effort)


def chat_request(
    req: ResponsesRequest, tools: ResponseTools, history: Sequence[ChatMessage] = ()
) -> tuple[ChatCompletionRequest, dict[str, str]]:
    """``req`` as the chat request it is served as: ``instructions`` as the system turn,
    ``history`` (the previous response's turns), then its input items; its tools
    (``tools``), choice and format in chat's terms.  With the client's name of each chat
    part of its input."""
    messages: list[ChatMessage] = []
    if req.instructions:
        messages.append(ChatMessage(role="system", content=req.instructions))
    messages += history
    turns, by_turn = named_turns(req.items(), tools)
    names = chat_names(len(messages), by_turn)
    messages += turns
    fields = {
        "model": req.model,
        "messages": messages,
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "stream": req.stream,
        "stream_options": {"include_usage": True} if req.stream else None,
        "ignore_eos": req.ignore_eos,
        "user": req.safety_identifier or req.user,
        **chat_fields(req, tools),
    }
    try:
        chat = ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        raise _invalid(exc) from None
    return chat.with_hints(edge_hints(req, tools)), names


def response_of(
    req: ResponsesRequest, tools: ResponseTools, done: ChatCompletion
) -> ResponseObject:
    """A whole chat answer to ``req``'s chat request shaped as the Response it answers."""
    output = output_items(done, tools, req.max_tool_calls)
    finish = done.choices[0].finish_reason
    return response_object(new_id("resp"), req, int(time.time()), output, finish, done.usage)


def _invalid(exc: ValidationError) -> InvalidRequest:
    """A chat-level rule the request breaks (a tool_choice naming no tool...), in its terms."""
    err = exc.errors()[0]
    ctx = err.get("ctx") or {}
    param = ctx.get("param") or ".".join(str(x) for x in err.get("loc", ())) or None
    return InvalidRequest(str(err.get("msg", "invalid request")), param=param, code="invalid_value")


class Responses:
    def __init__(self, answer: Ask, chat: Ask, store: SessionStore | None) -> None:
        self._answer = answer  # streamed: the first piece produced on return
        self._chat = chat  # whole
        self._store_ = store

    @property
    def _store(self) -> SessionStore:
        if self._store_ is None:
            raise Unavailable("the Responses API needs the session log", code="no_session_log")
        return self._store_

    async def _stored(self, response_id: str, who: Principal, param: str | None) -> ResponseRow:
        """The caller's stored, undeleted response (the store is read off the event loop)."""
        row = await asyncio.to_thread(self._store.response, response_id)
        if row is None or row.deleted or not row.stored or row.tenant != who.tenant:
            raise NotFound(
                f"Response with id '{response_id}' not found.", param=param, code="not_found"
            )
        return row

    async def _chat_request(
        self, req: ResponsesRequest, who: Principal, session: str | None, tools: ResponseTools
    ) -> tuple[ChatCompletionRequest, str | None, dict[str, str]]:
        """The chat request and its session: the previous response's, else ``session``
        (a header's or ``prompt_cache_key``), else None (found by the log's prefix
        digests); and the client's name of each chat part of its input."""
        history: list[ChatMessage] = []
        if req.previous_response_id is not None:
            row = await self._stored(req.previous_response_id, who, "previous_response_id")
            session = session_name(row.session_id)  # the name the chat path scopes again
            events = await asyncio.to_thread(self._store.events, row.session_id, row.seq)
            logged = fold(e for _, e in events).messages
            get = self._store.attachments.get  # read off the event loop, with the events
            history = await asyncio.to_thread(lambda: [logged_turn(m, get) for m in logged])
        chat, names = chat_request(req, tools, history)
        return chat, session, names

    async def _save(self, served: Served, body: ResponseObject, who: Principal) -> None:
        if (
            self._store_ is not None
            and served.session is not None
            and served.answer_seq is not None
        ):
            await asyncio.to_thread(
                self._store_.add_response,
                body.id,
                served.session,
                served.answer_seq,
                who.tenant,
                body.model_dump_json(),
                body.store,
            )

    async def create(
        self, req: ResponsesRequest, tools: ResponseTools, who: Principal, session: str | None
    ) -> Routed[ResponseObject]:
        """The whole response; ``tools``: the request's, in chat's terms (mapped once by
        the caller, :func:`~gateway.service.response_tools.response_tools`)."""
        chat, session, names = await self._chat_request(req, who, session, tools)
        try:
            done: Routed[ChatCompletion] = await self._chat(chat, who, None, session)
        except APIError as exc:
            named = client_named(exc, names)
            if named is exc:
                raise
            raise named from exc
        body = response_of(req, tools, done.body)
        await self._save(done.served, body, who)
        return Routed(body, done.served)

    async def stream(
        self, req: ResponsesRequest, tools: ResponseTools, who: Principal, session: str | None
    ) -> tuple[AsyncGenerator[list[StreamEvent], None], ResponseStream, Served]:
        """The response's events, started (first token) on return; the stream's state
        numbers an error event, should the answer fail after it started."""
        chat, session, names = await self._chat_request(req, who, session, tools)
        try:
            routed: Routed[Answer] = await self._answer(chat, who, None, session)
        except APIError as exc:
            named = client_named(exc, names)
            if named is exc:
                raise
            raise named from exc
        state = ResponseStream(new_id("resp"), req, int(time.time()), tools)
        served = routed.served

        async def events() -> AsyncGenerator[list[StreamEvent], None]:
            async for batch in state.events(routed.body.pieces):
                yield batch
            body = state.final()
            await self._save(served, body, who)
            kind = "response.incomplete" if body.status == "incomplete" else "response.completed"
            yield [ResponseState(type=kind, sequence_number=state.n(), response=body)]

        return events(), state, served

    async def get(self, response_id: str, who: Principal) -> dict[str, Any]:
        row = await self._stored(response_id, who, None)
        body: dict[str, Any] = json.loads(row.body)
        return body

    async def delete(self, response_id: str, who: Principal) -> ResponseDeleted:
        await self._stored(response_id, who, None)
        await asyncio.to_thread(self._store.delete_response, response_id)
        return ResponseDeleted(id=response_id)
