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
gets it through its adapter, and an alias falls back across both.  The
answer pieces are shaped here into a ``Message`` or its stream events.

Thinking blocks sent back in assistant turns are not shown to the local
model (as Anthropic's own models drop earlier turns' thinking from context).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from gateway.core.errors import InvalidRequest
from gateway.core.messages import (
    Block,
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    InputJsonDelta,
    Message,
    MessageDelta,
    MessageParam,
    MessagesRequest,
    MessageStart,
    MessageStop,
    MessageUsage,
    Ping,
    RedactedThinkingBlock,
    RedactedThinkingOut,
    SignatureDelta,
    StopDelta,
    StopReason,
    StreamEvent,
    TextBlock,
    TextDelta,
    TextOut,
    ThinkingBlock,
    ThinkingDelta,
    ThinkingOut,
    TokenCount,
    ToolResultBlock,
    ToolUseBlock,
    ToolUseOut,
    UnsupportedBlock,
)
from gateway.core.outputs import Usage
from gateway.core.schemas import (
    Breakpoint,
    ChatCompletionRequest,
    ChatMessage,
    EdgeHints,
    FunctionCallIn,
    FunctionSpec,
    JsonSchemaSpec,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    TextPart,
    ToolCallIn,
    ToolSpec,
)
from gateway.core.shaping import Piece, Pieces, collect
from gateway.core.types import Principal, Routed, RouteOverride
from gateway.service.chat import GatewayService

_STOP: dict[str, StopReason] = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "content_filter": "refusal",
}


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


# ---------------------------------------------------------------- request mapping


def _arguments(value: dict[str, Any]) -> str:
    """A tool_use block's input as the arguments text a tool-call parser gives (so the
    conversation the session log keeps is the one the model wrote)."""
    return json.dumps(value, ensure_ascii=False)


def _user(m: MessageParam, where: str, turns: list[ChatMessage]) -> bool:
    """Append a user turn: its tool results as tool turns, then its text.  True when a
    block of it carries a breakpoint."""
    text: list[TextPart] = []
    marked = False
    for j, b in enumerate(m.blocks()):
        if isinstance(b, UnsupportedBlock):
            raise InvalidRequest(
                f"{where}.content.{j}: '{b.type}' content is not supported by this gateway "
                "(text, tool_use and tool_result are)",
                param=f"{where}.content.{j}.type",
                code="unsupported_content",
            )
        if isinstance(b, ToolResultBlock):
            prefix = "[error] " if b.is_error else ""
            turns.append(
                ChatMessage(role="tool", content=prefix + b.text(), tool_call_id=b.tool_use_id)
            )
        elif isinstance(b, TextBlock):
            text.append(TextPart(type="text", text=b.text))
        else:
            raise InvalidRequest(
                f"{where}.content.{j}: a user turn cannot carry '{b.type}' blocks",
                param=f"{where}.content.{j}.type",
                code="invalid_value",
            )
        marked = marked or b.cache_control is not None
    if text:
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
        elif isinstance(b, UnsupportedBlock | ToolResultBlock):
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


def _tool(t: Any) -> ToolSpec:
    # Anthropic's names may be longer than OpenAI's 64 characters: built as validated here
    fn = FunctionSpec.model_construct(
        name=t.name, description=t.description, parameters=t.input_schema, strict=t.strict
    )
    return ToolSpec.model_construct(type="function", function=fn)


def _tool_choice(req: MessagesRequest) -> Any:
    c = req.tool_choice
    if c is None or not req.tools:
        return None
    if c.type == "tool":
        return NamedToolChoice(type="function", function=NamedFunction(name=c.name or ""))
    return {"auto": "auto", "any": "required", "none": "none"}[c.type]


def chat_request(req: MessagesRequest) -> ChatCompletionRequest:
    """The chat request a Messages request is served as, with its breakpoints."""
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
    for i, m in enumerate(req.messages):
        add = _user if m.role == "user" else _assistant
        ttl = max((b.cache_control.ttl_s() for b in m.blocks() if _mark(b)), default=300)
        if add(m, f"messages.{i}", turns) and turns:
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
    hints = EdgeHints(tuple(marks), clamp_output=True, top_k=req.top_k or None, thinking=thinking)
    return chat.with_hints(hints)


def _mark(b: Any) -> bool:
    return getattr(b, "cache_control", None) is not None


# ---------------------------------------------------------------- answers


def message_usage(u: Usage) -> MessageUsage:
    """OpenAI's usage in Anthropic's terms: ``input_tokens`` is what was neither read
    from the cache nor written to it."""
    read = u.prompt_tokens_details.cached_tokens
    written = u.prompt_tokens_details.cache_write_tokens or 0
    return MessageUsage(
        input_tokens=max(0, u.prompt_tokens - read - written),
        output_tokens=u.completion_tokens,
        cache_creation_input_tokens=written,
        cache_read_input_tokens=read,
    )


def _stopped(finish: str, stop_sequence: str | None) -> tuple[StopReason, str | None]:
    """Anthropic's stop reason: a stop string that ended the answer is ``stop_sequence``."""
    if finish == "stop" and stop_sequence:
        return "stop_sequence", stop_sequence
    return _STOP.get(finish, "end_turn"), None


def _thought(block: dict[str, Any]) -> ThinkingOut | RedactedThinkingOut:
    if block["type"] == "redacted_thinking":
        return RedactedThinkingOut(data=block["data"])
    return ThinkingOut(thinking=block["thinking"], signature=block["signature"])


def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


async def whole_message(mid: str, model: str, pieces: Pieces) -> Message:
    samples, usage = await collect(pieces)
    s = samples[0]
    content: list[Block] = [_thought(b) for b in s.thinking_blocks()]
    text = "".join(s.text)
    if text or not s.calls:
        content.append(TextOut(text=text))
    for c in s.tool_calls() or []:
        content.append(
            ToolUseOut(id=c.id, name=c.function.name, input=_input(c.function.arguments))
        )
    reason, seq = _stopped(s.finish_reason, s.stop_sequence)
    return Message(
        id=mid,
        model=model,
        content=content,
        stop_reason=reason,
        stop_sequence=seq,
        usage=message_usage(usage),
    )


async def _chain(first: Piece | None, rest: Pieces) -> Pieces:
    if first is not None:
        yield first
    async for p in rest:
        yield p


async def stream_events(mid: str, model: str, pieces: Pieces) -> AsyncGenerator[StreamEvent, None]:
    """The stream in Anthropic's events: a text block, then one tool_use block per call
    (its input as JSON deltas), each started when its first piece arrives.
    ``message_start`` carries the prompt's tokens where the engine knew them at the
    first token (the local one does); ``message_delta`` the totals."""
    index, open_kind = -1, ""
    blocks: dict[int, int] = {}  # tool call index → content block index
    thoughts: dict[int, int] = {}  # thinking block index → content block index
    finish, stop_sequence = "stop", None
    async with aclosing(pieces):
        first = await anext(pieces, None)  # produced already: the stream is primed
        prompt, read = (first.prompt_tokens or 0, first.cached_tokens or 0) if first else (0, 0)
        start = Message(
            id=mid, model=model, content=[], stop_reason=None,
            usage=MessageUsage(
                input_tokens=prompt - read, output_tokens=0, cache_read_input_tokens=read
            ),
        )  # fmt: skip
        yield MessageStart(message=start)
        yield Ping()
        async for p in _chain(first, pieces):
            for t in p.thinking:  # thinking blocks come first, each one whole in its turn
                if t.index not in thoughts:
                    if open_kind:
                        yield ContentBlockStop(index=index)
                    index, open_kind = index + 1, "thinking"
                    thoughts[t.index] = index
                    redacted = t.redacted is not None
                    block: Block = (
                        RedactedThinkingOut(data=t.redacted or "")
                        if redacted
                        else ThinkingOut(thinking="", signature="")
                    )
                    yield ContentBlockStart(index=index, content_block=block)
                at = thoughts[t.index]
                if t.text:
                    yield ContentBlockDelta(index=at, delta=ThinkingDelta(thinking=t.text))
                if t.signature:
                    yield ContentBlockDelta(index=at, delta=SignatureDelta(signature=t.signature))
            if p.text:
                if open_kind != "text":
                    if open_kind:
                        yield ContentBlockStop(index=index)
                    index, open_kind = index + 1, "text"
                    yield ContentBlockStart(index=index, content_block=TextOut(text=""))
                yield ContentBlockDelta(index=index, delta=TextDelta(text=p.text))
            for d in p.tool_calls:
                if d.index not in blocks:
                    if open_kind:
                        yield ContentBlockStop(index=index)
                    index, open_kind = index + 1, "tool"
                    blocks[d.index] = index
                    use = ToolUseOut(id=d.id or "", name=d.name or "", input={})
                    yield ContentBlockStart(index=index, content_block=use)
                if d.arguments:
                    delta = InputJsonDelta(partial_json=d.arguments)
                    yield ContentBlockDelta(index=blocks[d.index], delta=delta)
            finish = p.finish_reason or finish
            stop_sequence = p.stop_sequence or stop_sequence
            if p.usage is not None:
                if open_kind:
                    yield ContentBlockStop(index=index)
                    open_kind = ""
                reason, seq = _stopped(finish, stop_sequence)
                stop = StopDelta(stop_reason=reason, stop_sequence=seq)
                yield MessageDelta(delta=stop, usage=message_usage(p.usage))
    yield MessageStop()


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
        chat = chat_request(req).model_copy(update={"stream": False})

        async def shape(_: str, pieces: Pieces) -> Message:
            return await whole_message(message_id(), req.model, pieces)

        routed = await self._svc.whole(chat, who, shape, route, session)
        return Routed(routed.body[0], routed.served)

    async def stream(
        self,
        req: MessagesRequest,
        who: Principal,
        route: RouteOverride | None,
        session: str | None,
    ) -> Routed[AsyncGenerator[StreamEvent, None]]:
        """Started (its first token produced) when it returns: errors before it are
        raised here as HTTP errors, not inside a 200 stream."""
        routed = await self._svc.answer(chat_request(req), who, route, session)
        events = stream_events(message_id(), req.model, routed.body.pieces)
        return Routed(events, routed.served)

    def count_tokens(self, req: MessagesRequest) -> TokenCount:
        """The prompt's tokens as the local model renders it: what the next request
        reports as input + cache read + cache creation tokens."""
        chat = chat_request(req)
        self._svc.local_only(req.model, "token counts")
        self._svc.local.check_ready()
        ids = self._svc.local.chat_tokens(chat.messages, chat.tool_dicts() or None)
        return TokenCount(input_tokens=len(ids))
