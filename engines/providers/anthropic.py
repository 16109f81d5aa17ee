"""Anthropic Messages API: explicit ``cache_control`` breakpoints, ``max_tokens: 0`` warms.

Images travel as ``image`` blocks and documents as ``document`` blocks (a PDF
as a base64 source, a text document as a text source), each where it sits in
its turn or tool result, bytes as received; a breakpoint may close on one."""

from __future__ import annotations

import json
from typing import Any

from engines.providers import image_tokens
from engines.providers.base import (
    Answer,
    Attached,
    CacheDirectives,
    ChatCall,
    Delta,
    ProviderUsage,
    Rendered,
    ThinkingPart,
    ToolCall,
    ToolCallPart,
    Turn,
    base64_of,
    document_text,
    forced_tool,
    media_spans,
)
from engines.providers.errors import ProviderUnavailable, from_status
from engines.sse import ServerSentEvent
from manifest.canonical import canonical_json

API_VERSION = "2023-06-01"
SYSTEM_MESSAGE = "system-message"  # a segment's place: a system message among the messages
DEFAULT_MAX_TOKENS = 1024  # Anthropic requires max_tokens; OpenAI callers may omit it
_FINISH = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "tool_use": "tool_calls",
}


def _tool(t: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI function tool in Anthropic's shape (a deferred one stays deferred)."""
    fn = t["function"]
    out: dict[str, Any] = {
        "name": fn["name"],
        "input_schema": fn.get("parameters") or {"type": "object", "properties": {}},
    }
    if fn.get("description"):
        out["description"] = fn["description"]
    if t.get("defer_loading"):
        out["defer_loading"] = True
    return out


def _choice(choice: str | dict[str, Any], warm: bool) -> dict[str, Any] | None:
    """OpenAI's ``tool_choice`` in Anthropic's shape (a warm may not force a tool)."""
    name = forced_tool(choice)
    if name is not None or choice == "required":
        if warm:
            return None
        return {"type": "tool", "name": name} if name else {"type": "any"}
    return {"type": str(choice)}


def attachment_block(a: Attached) -> dict[str, Any]:
    """An image or a document as Anthropic's block, its bytes as received."""
    ref = a.attachment.ref
    block: dict[str, Any]
    if ref.kind == "image":
        source = {"type": "base64", "media_type": ref.media_type, "data": base64_of(a.attachment)}
        return {"type": "image", "source": source}
    if ref.media_type == "text/plain":
        text = document_text(a.attachment)
        block = {
            "type": "document",
            "source": {"type": "text", "media_type": ref.media_type, "data": text},
        }
    else:
        data = base64_of(a.attachment)
        block = {
            "type": "document",
            "source": {"type": "base64", "media_type": ref.media_type, "data": data},
        }
    if a.title:
        block["title"] = a.title
    return block


def _part_blocks(t: Turn) -> list[dict[str, Any]]:
    """A turn's parts as content blocks, in order (empty text left out: Anthropic refuses
    an empty text block)."""
    return [
        attachment_block(p) if isinstance(p, Attached) else {"type": "text", "text": p}
        for p in t.parts
        if isinstance(p, Attached) or p
    ]


def _turn_blocks(t: Turn) -> tuple[str, list[dict[str, Any]]]:
    """A turn as (role, content blocks): a tool's result is a user ``tool_result`` block,
    an assistant's calls are ``tool_use`` blocks after its text."""
    if t.role == "tool":
        content: Any = t.content
        if t.parts:  # images in the result, where they sit
            content = _part_blocks(t) + [dict(b) for b in t.tool_changes]
        elif t.tool_changes:  # a tool search's finds, as written
            text = [{"type": "text", "text": t.content}] if t.content else []
            content = text + [dict(b) for b in t.tool_changes]
        result = {"type": "tool_result", "tool_use_id": t.tool_call_id or "", "content": content}
        return "user", [result]
    if t.role == "system":  # a mid-conversation system message, its tool changes as written
        text = [{"type": "text", "text": t.content}] if t.content or not t.tool_changes else []
        return SYSTEM_MESSAGE, text + [dict(b) for b in t.tool_changes]
    blocks: list[dict[str, Any]] = [dict(b) for b in t.thinking]  # first, as written
    if t.parts:
        blocks += _part_blocks(t)
    elif t.content or not (t.tool_calls or t.thinking):
        blocks.append({"type": "text", "text": t.content})
    for c in t.tool_calls:
        blocks.append({"type": "tool_use", "id": c.id, "name": c.name, "input": c.args()})
    return t.role, blocks


def _is_results(message: dict[str, Any]) -> bool:
    return message["role"] == "user" and bool(message["content"][-1]["type"] == "tool_result")


def _usage(u: dict[str, Any], output: int) -> ProviderUsage:
    read = int(u.get("cache_read_input_tokens") or 0)
    write = int(u.get("cache_creation_input_tokens") or 0)
    return ProviderUsage(int(u.get("input_tokens") or 0) + read + write, read, write, output)


# OpenAI's effort levels in Anthropic's terms
ANTHROPIC_EFFORT = {"none": "low", "minimal": "low"}


class AnthropicAdapter:
    provider = "anthropic"

    def auth_headers(self, api_key: str) -> dict[str, str]:
        return {"x-api-key": api_key, "anthropic-version": API_VERSION}

    def render(self, call: ChatCall, cache: CacheDirectives) -> Rendered:
        marker = {"type": "ephemeral", "ttl": "1h" if cache.ttl_s > 300 else "5m"}
        long_marker = {"type": "ephemeral", "ttl": "1h"}  # long-tier breakpoints come first
        # (segment key, place, blocks): the marker goes on a segment's last block
        segments: list[tuple[str, str, list[dict[str, Any]]]] = []
        if call.system:
            segments.append(("system", "system", [{"type": "text", "text": call.system}]))
        if call.volatile_system:
            text = {"type": "text", "text": call.volatile_system}
            segments.append(("system:volatile", "system", [text]))
        controls = {f"message:{i}": t.control for i, t in enumerate(call.turns) if t.control}
        for i, t in enumerate(call.turns):
            segments.append((f"message:{i}", *_turn_blocks(t)))
        prompt = b""
        ends: dict[str, int] = {}
        tools = [_tool(spec) for spec in call.tools]
        for tool in tools:
            prompt += canonical_json(tool)
        if tools:
            ends["tools"] = len(prompt)
            if "tools" in cache.breakpoints:  # the marker goes on the last tool
                mark = long_marker if "tools" in cache.long_ttl else marker
                tools[-1] = {**tools[-1], "cache_control": mark}
        system: list[dict[str, Any]] = []
        messages: list[dict[str, Any]] = []
        for key, place, blocks in segments:
            for block in blocks:
                prompt += canonical_json(block)
            ends[key] = len(prompt)
            if key in cache.breakpoints:
                mark = long_marker if key in cache.long_ttl else marker
                blocks = [*blocks[:-1], {**blocks[-1], "cache_control": mark}]
            if place == "system":
                system += blocks
            elif place == SYSTEM_MESSAGE:
                messages.append({"role": "system", "content": blocks, **controls.get(key, {})})
            elif (
                place == "user"
                and blocks[0]["type"] == "tool_result"
                and messages
                and (_is_results(messages[-1]))
            ):  # parallel calls' results travel in one user message
                messages[-1]["content"] += blocks
            else:
                messages.append({"role": place, "content": blocks, **controls.get(key, {})})
        body: dict[str, Any] = {
            "model": call.model,
            "max_tokens": 0 if cache.warm else (call.max_tokens or DEFAULT_MAX_TOKENS),
            "messages": messages,
        }
        if tools:
            body["tools"] = tools
        choice = _choice(call.tool_choice, cache.warm) if call.tool_choice else None
        if choice is not None:
            body["tool_choice"] = choice
        if system:
            body["system"] = system
        if call.stream and not cache.warm:
            body["stream"] = True
        for name, value in (("temperature", call.temperature), ("top_p", call.top_p)):
            if value is not None:
                body[name] = value
        if call.stop:
            body["stop_sequences"] = list(call.stop)
        if call.thinking is not None and not cache.warm:
            body["thinking"] = dict(call.thinking)
        if call.effort is not None and not cache.warm:
            body["output_config"] = {"effort": ANTHROPIC_EFFORT.get(call.effort, call.effort)}
        if call.context_management is not None:
            body["context_management"] = dict(call.context_management)
        if call.safeguards is not None:
            body["safeguards"] = [dict(s) for s in call.safeguards]
        media = media_spans(prompt, call.turns, lambda a: image_tokens.anthropic(a.attachment.ref))
        stream = bool(body.get("stream"))
        return Rendered("/messages", canonical_json(body), prompt, ends, stream, media)

    def parse(self, body: Any) -> Answer:
        content = body.get("content", [])
        text = "".join(b.get("text", "") for b in content if b.get("type") == "text")
        calls = tuple(
            ToolCall(str(b["id"]), str(b["name"]), json.dumps(b.get("input") or {}))
            for b in content
            if b.get("type") == "tool_use"
        )
        u = body.get("usage") or {}
        usage = _usage(u, int(u.get("output_tokens") or 0))
        finish = _FINISH.get(str(body.get("stop_reason")), "stop")
        thoughts = [b for b in content if b.get("type") in ("thinking", "redacted_thinking")]
        thinking = tuple(
            ThinkingPart(
                i,
                str(b.get("thinking", "")),
                str(b.get("signature", "")),
                b.get("data") if b["type"] == "redacted_thinking" else None,
            )
            for i, b in enumerate(thoughts)
        )
        stop = body.get("stop_sequence")
        return Answer(text, usage, finish, calls, thinking, stop if isinstance(stop, str) else None)

    def stream_parser(self) -> _StreamParser:
        return _StreamParser()


class _StreamParser:
    def __init__(self) -> None:
        self._usage: dict[str, Any] = {}
        self._calls: dict[int, int] = {}  # content block index → tool call index
        self._thoughts: dict[int, int] = {}  # content block index → thinking block index

    def feed(self, event: ServerSentEvent) -> list[Delta]:
        if not event.data:
            return []
        data = json.loads(event.data)
        kind = data.get("type")
        if kind == "message_start":
            self._usage = dict(data["message"].get("usage") or {})
        elif kind == "content_block_start" and data["content_block"].get("type") == "tool_use":
            block = data["content_block"]
            call = self._calls[int(data["index"])] = len(self._calls)
            return [Delta(tool_calls=(ToolCallPart(call, str(block["id"]), str(block["name"])),))]
        elif kind == "content_block_start" and data["content_block"].get("type") in (
            "thinking",
            "redacted_thinking",
        ):
            block = data["content_block"]
            n = self._thoughts[int(data["index"])] = len(self._thoughts)
            redacted = block.get("data") if block["type"] == "redacted_thinking" else None
            part = ThinkingPart(n, str(block.get("thinking", "")), "", redacted)
            return [Delta(thinking=(part,))]
        elif kind == "content_block_delta":
            delta = data["delta"]
            if delta.get("type") == "text_delta":
                return [Delta(text=delta["text"])]
            if delta.get("type") in ("thinking_delta", "signature_delta"):
                n = self._thoughts[int(data["index"])]
                text, sig = str(delta.get("thinking", "")), str(delta.get("signature", ""))
                return [Delta(thinking=(ThinkingPart(n, text, sig),))]
            if delta.get("type") == "input_json_delta" and delta.get("partial_json"):
                call = self._calls[int(data["index"])]
                return [Delta(tool_calls=(ToolCallPart(call, arguments=delta["partial_json"]),))]
        elif kind == "message_delta":
            out = int((data.get("usage") or {}).get("output_tokens") or 0)
            reason = _FINISH.get(str(data["delta"].get("stop_reason")), "stop")
            stop = data["delta"].get("stop_sequence")
            seq = stop if isinstance(stop, str) else None
            return [Delta(usage=_usage(self._usage, out), finish_reason=reason, stop_sequence=seq)]
        elif kind == "error":
            err = data.get("error") or {}
            if err.get("type") == "overloaded_error":
                raise from_status("anthropic", 529, str(err.get("message")))
            raise ProviderUnavailable("anthropic", f"stream error: {err.get('message')}")
        return []
