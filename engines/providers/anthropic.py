"""Anthropic Messages API: explicit ``cache_control`` breakpoints, ``max_tokens: 0`` warms."""

from __future__ import annotations

import json
from typing import Any

from engines.providers.base import (
    Answer,
    CacheDirectives,
    ChatCall,
    Delta,
    ProviderUsage,
    Rendered,
)
from engines.providers.errors import ProviderUnavailable, from_status
from engines.sse import ServerSentEvent
from manifest.canonical import canonical_json

API_VERSION = "2023-06-01"
DEFAULT_MAX_TOKENS = 1024  # Anthropic requires max_tokens; OpenAI callers may omit it
_FINISH = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length"}


def _tool(t: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI function tool in Anthropic's shape."""
    fn = t["function"]
    out: dict[str, Any] = {
        "name": fn["name"],
        "input_schema": fn.get("parameters") or {"type": "object", "properties": {}},
    }
    if fn.get("description"):
        out["description"] = fn["description"]
    return out


def _usage(u: dict[str, Any], output: int) -> ProviderUsage:
    read = int(u.get("cache_read_input_tokens") or 0)
    write = int(u.get("cache_creation_input_tokens") or 0)
    return ProviderUsage(int(u.get("input_tokens") or 0) + read + write, read, write, output)


class AnthropicAdapter:
    provider = "anthropic"

    def auth_headers(self, api_key: str) -> dict[str, str]:
        return {"x-api-key": api_key, "anthropic-version": API_VERSION}

    def render(self, call: ChatCall, cache: CacheDirectives) -> Rendered:
        marker = {"type": "ephemeral", "ttl": "1h" if cache.ttl_s > 300 else "5m"}
        blocks: list[tuple[str, str, dict[str, Any]]] = []  # (segment key, place, block)
        if call.system:
            blocks.append(("system", "system", {"type": "text", "text": call.system}))
        if call.volatile_system:
            text = {"type": "text", "text": call.volatile_system}
            blocks.append(("system:volatile", "system", text))
        for i, t in enumerate(call.turns):
            blocks.append((f"message:{i}", t.role, {"type": "text", "text": t.content}))
        prompt = b""
        ends: dict[str, int] = {}
        tools = [_tool(spec) for spec in call.tools]
        for tool in tools:
            prompt += canonical_json(tool)
        if tools:
            ends["tools"] = len(prompt)
            if "tools" in cache.breakpoints:  # the marker goes on the last tool
                tools[-1] = {**tools[-1], "cache_control": marker}
        system: list[dict[str, Any]] = []
        messages: list[dict[str, Any]] = []
        for key, place, block in blocks:
            prompt += canonical_json(block)
            ends[key] = len(prompt)
            sent = {**block, "cache_control": marker} if key in cache.breakpoints else block
            if place == "system":
                system.append(sent)
            else:
                messages.append({"role": place, "content": [sent]})
        body: dict[str, Any] = {
            "model": call.model,
            "max_tokens": 0 if cache.warm else (call.max_tokens or DEFAULT_MAX_TOKENS),
            "messages": messages,
        }
        if tools:
            body["tools"] = tools
        if call.tool_choice:
            body["tool_choice"] = {"type": call.tool_choice}
        if system:
            body["system"] = system
        if call.stream and not cache.warm:
            body["stream"] = True
        for name, value in (("temperature", call.temperature), ("top_p", call.top_p)):
            if value is not None:
                body[name] = value
        if call.stop:
            body["stop_sequences"] = list(call.stop)
        return Rendered("/messages", canonical_json(body), prompt, ends, bool(body.get("stream")))

    def parse(self, body: Any) -> Answer:
        text = "".join(
            b.get("text", "") for b in body.get("content", []) if b.get("type") == "text"
        )
        u = body.get("usage") or {}
        usage = _usage(u, int(u.get("output_tokens") or 0))
        return Answer(text, usage, _FINISH.get(str(body.get("stop_reason")), "stop"))

    def stream_parser(self) -> _StreamParser:
        return _StreamParser()


class _StreamParser:
    def __init__(self) -> None:
        self._usage: dict[str, Any] = {}

    def feed(self, event: ServerSentEvent) -> list[Delta]:
        if not event.data:
            return []
        data = json.loads(event.data)
        kind = data.get("type")
        if kind == "message_start":
            self._usage = dict(data["message"].get("usage") or {})
        elif kind == "content_block_delta" and data["delta"].get("type") == "text_delta":
            return [Delta(text=data["delta"]["text"])]
        elif kind == "message_delta":
            out = int((data.get("usage") or {}).get("output_tokens") or 0)
            reason = _FINISH.get(str(data["delta"].get("stop_reason")), "stop")
            return [Delta(usage=_usage(self._usage, out), finish_reason=reason)]
        elif kind == "error":
            err = data.get("error") or {}
            if err.get("type") == "overloaded_error":
                raise from_status("anthropic", 529, str(err.get("message")))
            raise ProviderUnavailable("anthropic", f"stream error: {err.get('message')}")
        return []
