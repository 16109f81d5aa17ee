"""Anthropic's Messages API over the one chat path.

A Messages request is mapped once into the chat request every target serves
(:func:`chat_request`): the system blocks become the system prompt, tools
become function tools, ``tool_use`` blocks an assistant's tool calls and
``tool_result`` blocks tool turns, and each ``cache_control`` marker a
:class:`~gateway.core.schemas.Breakpoint` on the segment it closes.  On the
local model the conversation goes through the model's chat template and tool
parser exactly as ``/v1/chat/completions`` renders it (same token ids, same
exact prediction), a ``max_tokens`` beyond the context is cut to fit, and
the blocks through each breakpoint are leased for its TTL; a hosted provider
gets it through its adapter (an Anthropic target gets the client's own
breakpoints and thinking blocks as written), and an alias falls back across
both.  The answer pieces are shaped by :mod:`gateway.service.message_answers`.

Images and documents become the chat request's content parts where they sit
(in a turn or in a ``tool_result``), so one intake decodes, fetches, bounds
and stores every image whatever API it came by: an ``image`` block as an
``image_url`` part (a base64 source as a data URL, a URL source as its URL), a
``document`` block as a ``file`` part (a PDF as a data URL, a text source as a
``text/plain`` data URL of its UTF-8 bytes, which an Anthropic target gets back
as a text source; ``title`` as the file name); a ``cache_control`` on one is a
breakpoint like a text block's.  What cannot be served is refused by name:
Files API sources, URL and ``content`` document sources, citations and
``context`` on documents, ``search_result`` and ``container_upload`` blocks.

Thinking blocks sent back in assistant turns are not shown to the local
model (as Anthropic's own models drop earlier turns' thinking from context).
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import AsyncGenerator
from typing import Any, NamedTuple

from gateway.core.errors import APIError, InvalidRequest
from gateway.core.messages_wire import (
    Base64Source,
    DocumentBlock,
    ImageBlock,
    Message,
    MessageParam,
    MessagesRequest,
    RedactedThinkingBlock,
    StreamEvent,
    TextBlock,
    TextSource,
    ThinkingBlock,
    TokenCount,
    ToolAdditionBlock,
    ToolRemovalBlock,
    ToolResultBlock,
    ToolUseBlock,
    UnsupportedBlock,
    UrlSource,
)
from gateway.core.pieces import Pieces
from gateway.core.schemas import (
    Breakpoint,
    ChatCompletionRequest,
    ChatMessage,
    EdgeHints,
    FileData,
    FilePart,
    FunctionCallIn,
    FunctionSpec,
    ImageUrl,
    ImageUrlPart,
    JsonSchemaSpec,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    TextPart,
    ToolCallIn,
    ToolSpec,
)
from gateway.core.types import Principal, Routed, RouteOverride
from gateway.service.chat import GatewayService
from gateway.service.message_answers import stream_events, whole_message
from gateway.service.part_names import chat_names, client_named


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


# ---------------------------------------------------------------- request mapping


def _arguments(value: dict[str, Any]) -> str:
    """A tool_use block's input as the arguments text a tool-call parser gives (so the
    conversation the session log keeps is the one the model wrote)."""
    return json.dumps(value, ensure_ascii=False)


Part = TextPart | ImageUrlPart | FilePart


def _unsupported(where: str, what: str, param: str) -> InvalidRequest:
    return InvalidRequest(
        f"{where}: {what} is not supported by this gateway",
        param=param,
        code="unsupported_content",
    )


def attachment_part(b: ImageBlock | DocumentBlock, where: str) -> ImageUrlPart | FilePart:
    """An image or a document block as the chat content part intake reads."""
    src = b.source
    if isinstance(b, ImageBlock):
        if isinstance(src, Base64Source):
            url = f"data:{src.media_type};base64,{src.data}"
        elif isinstance(src, UrlSource):
            url = src.url
        else:
            raise _unsupported(
                where, f"an image source of type '{src.type}'", f"{where}.source.type"
            )
        return ImageUrlPart(type="image_url", image_url=ImageUrl(url=url))
    if b.context is not None:
        raise _unsupported(where, "a document's context", f"{where}.context")
    if b.citations is not None and b.citations.enabled:
        raise _unsupported(where, "citations", f"{where}.citations")
    if isinstance(src, Base64Source):
        data = f"data:{src.media_type};base64,{src.data}"
    elif isinstance(src, TextSource):
        text = base64.b64encode(src.data.encode("utf-8")).decode("ascii")
        data = f"data:text/plain;base64,{text}"
    else:
        what = f"a document source of type '{src.type}' (send the bytes as base64)"
        raise _unsupported(where, what, f"{where}.source.type")
    return FilePart(type="file", file=FileData(file_data=data, filename=b.title))


def _result(b: ToolResultBlock, where: str) -> tuple[ChatMessage, list[str]]:
    """A tool result as a tool turn: its text, and its images and documents where they
    sit; with the client's name of each part (see :func:`client_named`)."""
    prefix = "[error] " if b.is_error else ""
    if not isinstance(b.content, list) or not any(
        isinstance(c, ImageBlock | DocumentBlock) for c in b.content
    ):
        text = prefix + b.text()
        return ChatMessage(role="tool", content=text, tool_call_id=b.tool_use_id), []
    parts: list[Part] = [TextPart(type="text", text=prefix)] if prefix else []
    names = [f"{where}.is_error"] if prefix else []
    for k, c in enumerate(b.content):
        if isinstance(c, TextBlock):
            parts.append(TextPart(type="text", text=c.text))
        elif isinstance(c, ImageBlock | DocumentBlock):
            parts.append(attachment_part(c, f"{where}.content.{k}"))
        else:
            continue
        names.append(f"{where}.content.{k}")
    return ChatMessage(role="tool", content=parts, tool_call_id=b.tool_use_id), names


def _user(
    m: MessageParam, where: str, turns: list[ChatMessage], names: dict[int, list[str]]
) -> bool:
    """Append a user turn: its tool results as tool turns, then its text, images and
    documents (``names``: the client's name of each part of each turn appended, by
    turn).  True when a block of it carries a breakpoint."""
    text: list[Part] = []
    own: list[str] = []
    marked = False
    for j, b in enumerate(m.blocks()):
        if isinstance(b, UnsupportedBlock):
            raise InvalidRequest(
                f"{where}.content.{j}: '{b.type}' content is not supported by this gateway "
                "(text, image, document, tool_use and tool_result are)",
                param=f"{where}.content.{j}.type",
                code="unsupported_content",
            )
        if isinstance(b, ToolResultBlock):
            result, names[len(turns)] = _result(b, f"{where}.content.{j}")
            turns.append(result.with_tool_changes(b.references()))  # a tool search's finds
        elif isinstance(b, ImageBlock | DocumentBlock):
            text.append(attachment_part(b, f"{where}.content.{j}"))
            own.append(f"{where}.content.{j}")
        elif isinstance(b, TextBlock):
            text.append(TextPart(type="text", text=b.text))
            own.append(f"{where}.content.{j}")
        else:
            raise InvalidRequest(
                f"{where}.content.{j}: a user turn cannot carry '{b.type}' blocks",
                param=f"{where}.content.{j}.type",
                code="invalid_value",
            )
        marked = marked or b.cache_control is not None
    if text:
        names[len(turns)] = own
        turns.append(ChatMessage(role="user", content=text))
    return marked


def _assistant(m: MessageParam, where: str, turns: list[ChatMessage]) -> bool:
    text: list[TextPart] = []
    calls: list[ToolCallIn] = []
    thoughts: list[dict[str, Any]] = []  # relayed to the provider that wrote them, as written
    marked = False
    for j, b in enumerate(m.blocks()):
        if isinstance(b, TextBlock):
            text.append(TextPart(type="text", text=b.text))
        elif isinstance(b, ThinkingBlock | RedactedThinkingBlock):
            thoughts.append(b.model_dump(exclude_none=True, exclude={"cache_control"}))
        elif isinstance(b, ToolUseBlock):
            fn = FunctionCallIn(name=b.name, arguments=_arguments(b.input))
            calls.append(ToolCallIn(id=b.id, function=fn))
        elif isinstance(b, UnsupportedBlock | ToolResultBlock | ImageBlock | DocumentBlock):
            raise InvalidRequest(
                f"{where}.content.{j}: an assistant turn cannot carry '{b.type}' blocks",
                param=f"{where}.content.{j}.type",
                code="invalid_value",
            )
        marked = marked or b.cache_control is not None
    content = text if text else ("" if not calls else None)
    turn = ChatMessage(role="assistant", content=content, tool_calls=calls or None)
    turns.append(turn.with_thinking(thoughts))
    return marked


def _system(m: MessageParam, where: str, turns: list[ChatMessage]) -> bool:
    """Append a mid-conversation system message where it sits: its text, and its tool
    changes as written (each target renders them: see
    :func:`engines.providers.base.tool_change_text`)."""
    text: list[TextPart] = []
    changes: list[dict[str, Any]] = []
    marked = m.cache_control is not None
    for b in m.blocks():
        if isinstance(b, TextBlock):
            text.append(TextPart(type="text", text=b.text))
        elif isinstance(b, ToolAdditionBlock | ToolRemovalBlock):
            changes.append(b.model_dump(exclude_none=True, exclude={"cache_control"}))
        marked = marked or b.cache_control is not None
    turns.append(ChatMessage(role="system", content=text).with_tool_changes(changes))
    return marked


def _tool(t: Any) -> ToolSpec:
    # Anthropic's names may be longer than OpenAI's 64 characters: built as validated here
    fn = FunctionSpec.model_construct(
        name=t.name, description=t.description, parameters=t.input_schema, strict=t.strict
    )
    deferred = True if t.defer_loading else None
    return ToolSpec.model_construct(type="function", function=fn, defer_loading=deferred)


def _tool_choice(req: MessagesRequest) -> Any:
    c = req.tool_choice
    if c is None or not req.tools:
        return None
    if c.type == "tool":
        return NamedToolChoice(type="function", function=NamedFunction(name=c.name or ""))
    return {"auto": "auto", "any": "required", "none": "none"}[c.type]


class Mapped(NamedTuple):
    chat: ChatCompletionRequest
    names: dict[str, str]  # a chat part's name → the client's (see client_named)


def chat_request(req: MessagesRequest) -> ChatCompletionRequest:
    """The chat request a Messages request is served as, with its breakpoints."""
    return mapped(req).chat


def mapped(req: MessagesRequest) -> Mapped:
    """The chat request a Messages request is served as, with its breakpoints, and the
    client's name of each chat part that carries an image or a document."""
    marks: list[Breakpoint] = []
    for tool in req.tools or []:
        if tool.cache_control is not None:
            marks.append(Breakpoint("tools", tool.cache_control.ttl_s()))
    blocks = req.system_blocks()
    messages = []
    if blocks:
        messages.append(ChatMessage(role="system", content="\n\n".join(b.text for b in blocks)))
        marks += [Breakpoint("system", b.cache_control.ttl_s()) for b in blocks if b.cache_control]
    turns: list[ChatMessage] = []
    names: dict[int, list[str]] = {}
    for i, m in enumerate(req.messages):
        ttl = max((b.cache_control.ttl_s() for b in m.blocks() if _mark(b)), default=300)
        if m.cache_control is not None:
            ttl = max(ttl, m.cache_control.ttl_s())
        if m.role == "user":
            marked = _user(m, f"messages.{i}", turns, names)
        else:
            add = {"assistant": _assistant, "system": _system}[m.role]
            marked = add(m, f"messages.{i}", turns)
        if m.output_config is not None and turns:  # per-turn control, on its last turn
            own = m.output_config.model_dump(exclude_none=True, by_alias=True)
            turns[-1].with_control({"output_config": own})
        if marked and turns:
            marks.append(Breakpoint(f"message:{len(turns) - 1}", ttl))
    if not turns:
        raise InvalidRequest("messages: at least one message must have content", param="messages")
    if req.cache_control is not None:  # automatic caching: through the last block
        marks.append(Breakpoint(f"message:{len(turns) - 1}", req.cache_control.ttl_s()))
    fmt = req.output_config.format if req.output_config else None
    chat = ChatCompletionRequest.model_construct(
        model=req.model,
        messages=messages + turns,
        max_tokens=req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p if req.top_p else None,
        stop=list(req.stop_sequences or ()) or None,
        stream=req.stream,
        tools=[_tool(t) for t in req.tools] if req.tools else None,
        tool_choice=_tool_choice(req),
        parallel_tool_calls=(
            False if req.tool_choice and req.tool_choice.disable_parallel_tool_use else None
        ),
        response_format=(
            ResponseFormat(
                type="json_schema",
                json_schema=JsonSchemaSpec(name="output", schema=fmt.schema_),
            )
            if fmt is not None
            else None
        ),
    )
    thinking = req.thinking.model_dump(exclude_none=True) if req.thinking else None
    effort = req.output_config.effort if req.output_config else None
    hints = EdgeHints(
        tuple(marks),
        clamp_output=True,
        top_k=req.top_k or None,
        thinking=thinking,
        effort=effort,
        context_management=req.context_management,
        safeguards=req.safeguards,
    )
    return Mapped(chat.with_hints(hints), chat_names(len(messages), names))


def _mark(b: Any) -> bool:
    return getattr(b, "cache_control", None) is not None


class Messages:
    def __init__(self, svc: GatewayService) -> None:
        self._svc = svc

    async def create(
        self,
        req: MessagesRequest,
        who: Principal,
        route: RouteOverride | None,
        session: str | None,
    ) -> Routed[Message]:
        chat, names = mapped(req)
        chat = chat.model_copy(update={"stream": False})

        async def shape(_: str, pieces: Pieces) -> Message:
            return await whole_message(message_id(), req.model, pieces)

        try:
            routed = await self._svc.whole(chat, who, shape, route, session)
        except APIError as exc:
            named = client_named(exc, names)
            if named is exc:
                raise
            raise named from exc
        return Routed(routed.body[0], routed.served)

    async def stream(
        self,
        req: MessagesRequest,
        who: Principal,
        route: RouteOverride | None,
        session: str | None,
    ) -> Routed[AsyncGenerator[list[StreamEvent], None]]:
        """Started (its first token produced) when it returns: errors before it are
        raised here as HTTP errors, not inside a 200 stream."""
        chat, names = mapped(req)
        try:
            routed = await self._svc.answer(chat, who, route, session)
        except APIError as exc:
            named = client_named(exc, names)
            if named is exc:
                raise
            raise named from exc
        events = stream_events(message_id(), req.model, routed.body.pieces)
        return Routed(events, routed.served)

    async def count_tokens(self, req: MessagesRequest) -> TokenCount:
        """The prompt's tokens as the local model renders it: what the next request
        reports as input + cache read + cache creation tokens."""
        chat, names = mapped(req)
        self._svc.local_only(req.model, "token counts")
        local = self._svc.local
        if local.sees and any(chat.attachment_parts()):  # a vision model counts its images
            local.check_ready()
            try:
                await self._svc.loop.intake.take(chat)
                ids, _ = await local.chat_prompt(chat)
            except APIError as exc:
                raise client_named(exc, names) from exc
            return TokenCount(input_tokens=len(ids))
        for i, m in enumerate(chat.messages):  # the local model reads text only
            for j, p in enumerate(m.content if isinstance(m.content, list) else []):
                if not isinstance(p, TextPart):
                    where = names.get(f"messages[{i}].content[{j}]", f"messages[{i}]")
                    raise InvalidRequest(
                        f"{where}: token counts are the local model's, which reads text "
                        "only; it cannot count an image or a document",
                        param=where,
                        code="unsupported_content",
                    )
        self._svc.local.check_ready()
        ids = await self._svc.local.chat_tokens(chat.messages, chat.tool_dicts() or None)
        return TokenCount(input_tokens=len(ids))
