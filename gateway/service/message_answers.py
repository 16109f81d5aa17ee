"""Answer pieces in the shapes of Anthropic's Messages API: a whole ``Message`` or its
stream of events, and usage in Anthropic's terms.

Thinking blocks (a provider's, relayed as written) come first, then the text,
then one ``tool_use`` block per call.  A stop string that ended the answer is
``stop_reason: stop_sequence`` with the string named.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from gateway.core.messages_wire import (
    Block,
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    InputJsonDelta,
    Message,
    MessageDelta,
    MessageStart,
    MessageStop,
    MessageUsage,
    Ping,
    RedactedThinkingOut,
    SignatureDelta,
    StopDelta,
    StopReason,
    StreamEvent,
    TextDelta,
    TextOut,
    ThinkingDelta,
    ThinkingOut,
    ToolUseOut,
)
from gateway.core.outputs import Usage
from gateway.core.pieces import Piece, Pieces
from gateway.core.samples import collect

_STOP: dict[str, StopReason] = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "content_filter": "refusal",
}


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


async def stream_events(
    mid: str, model: str, pieces: Pieces
) -> AsyncGenerator[list[StreamEvent], None]:
    """The stream in Anthropic's events: a text block, then one tool_use block per call
    (its input as JSON deltas), each started when its first piece arrives.
    ``message_start`` carries the prompt's tokens where the engine knew them at the
    first token (the local one does); ``message_delta`` the totals.  Yields the events
    of one piece together (the message's start with the first piece's, its stop with
    the last's): they are made at once, and go out in one write."""
    index, open_kind = -1, ""
    blocks: dict[int, int] = {}  # tool call index → content block index
    thoughts: dict[int, int] = {}  # thinking block index → content block index
    finish, stop_sequence = "stop", None
    stopped = False
    async with aclosing(pieces):
        first = await anext(pieces, None)  # produced already: the stream is primed
        prompt, read = (first.prompt_tokens or 0, first.cached_tokens or 0) if first else (0, 0)
        start = Message(
            id=mid,
            model=model,
            content=[],
            stop_reason=None,
            usage=MessageUsage(
                input_tokens=prompt - read, output_tokens=0, cache_read_input_tokens=read
            ),
        )
        out: list[StreamEvent] = [MessageStart(message=start), Ping()]
        async for p in _chain(first, pieces):
            for t in p.thinking:  # thinking blocks come first, each one whole in its turn
                if t.index not in thoughts:
                    if open_kind:
                        out.append(ContentBlockStop(index=index))
                    index, open_kind = index + 1, "thinking"
                    thoughts[t.index] = index
                    redacted = t.redacted is not None
                    block: Block = (
                        RedactedThinkingOut(data=t.redacted or "")
                        if redacted
                        else ThinkingOut(thinking="", signature="")
                    )
                    out.append(ContentBlockStart(index=index, content_block=block))
                at = thoughts[t.index]
                if t.text:
                    out.append(ContentBlockDelta(index=at, delta=ThinkingDelta(thinking=t.text)))
                if t.signature:
                    signed = SignatureDelta(signature=t.signature)
                    out.append(ContentBlockDelta(index=at, delta=signed))
            if p.text:
                if open_kind != "text":
                    if open_kind:
                        out.append(ContentBlockStop(index=index))
                    index, open_kind = index + 1, "text"
                    out.append(ContentBlockStart(index=index, content_block=TextOut(text="")))
                out.append(ContentBlockDelta(index=index, delta=TextDelta(text=p.text)))
            for d in p.tool_calls:
                if d.index not in blocks:
                    if open_kind:
                        out.append(ContentBlockStop(index=index))
                    index, open_kind = index + 1, "tool"
                    blocks[d.index] = index
                    use = ToolUseOut(id=d.id or "", name=d.name or "", input={})
                    out.append(ContentBlockStart(index=index, content_block=use))
                if d.arguments:
                    delta = InputJsonDelta(partial_json=d.arguments)
                    out.append(ContentBlockDelta(index=blocks[d.index], delta=delta))
            finish = p.finish_reason or finish
            stop_sequence = p.stop_sequence or stop_sequence
            if p.usage is not None:  # the last piece
                if open_kind:
                    out.append(ContentBlockStop(index=index))
                    open_kind = ""
                reason, seq = _stopped(finish, stop_sequence)
                stop = StopDelta(stop_reason=reason, stop_sequence=seq)
                out += [MessageDelta(delta=stop, usage=message_usage(p.usage)), MessageStop()]
                stopped = True
            if out:
                yield out
                out = []
        if out:  # no piece came
            yield out
    if not stopped:
        yield [MessageStop()]
