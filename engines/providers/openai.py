"""OpenAI Chat Completions (implicit caching, ``prompt_cache_key``) and DeepSeek (its dialect).

Images travel as ``image_url`` parts (a data URL of the bytes as received, with the
client's ``detail``), PDFs as ``file`` parts, a text document as a text part.  A tool
message takes text only, so a tool result's images follow the run of tool messages in
a user message of their own (in the prompt where they are in the body).  DeepSeek's
API takes no images (``specs.ProviderSpec.sees``): its adapter refuses them by name."""

from __future__ import annotations

import json
from collections.abc import Sequence
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
    ToolCall,
    ToolCallPart,
    Turn,
    data_url,
    document_text,
    effective_effort,
    media_spans,
    system_text,
)
from engines.providers.errors import ProviderBadRequest, ProviderUnavailable
from engines.sse import ServerSentEvent
from manifest.canonical import canonical_json


def attachment_part(a: Attached) -> dict[str, Any]:
    """An image or a document as a Chat Completions content part, bytes as received."""
    ref = a.attachment.ref
    if ref.kind == "image":
        image: dict[str, Any] = {"url": data_url(a.attachment)}
        if a.detail is not None:
            image["detail"] = a.detail
        return {"type": "image_url", "image_url": image}
    if ref.media_type == "text/plain":
        return {"type": "text", "text": document_text(a.attachment)}
    return {
        "type": "file",
        "file": {"filename": a.title or "document.pdf", "file_data": data_url(a.attachment)},
    }


def _content_parts(t: Turn) -> list[dict[str, Any]]:
    """A turn's parts as content parts, in order (empty text left out)."""
    return [
        attachment_part(p) if isinstance(p, Attached) else {"type": "text", "text": p}
        for p in t.parts
        if isinstance(p, Attached) or p
    ]


def _message(t: Turn, tools: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A turn as a Chat Completions message (an assistant's calls, a tool's result; a
    system message where it sits, its tool changes written into it)."""
    if t.role == "system":
        return {"role": "system", "content": system_text(t, tools)}
    if t.role == "tool":
        text = system_text(t, tools)
        return {"role": "tool", "tool_call_id": t.tool_call_id or "", "content": text}
    if t.tool_calls:
        calls = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in t.tool_calls
        ]
        return {"role": "assistant", "content": t.content or None, "tool_calls": calls}
    if t.parts:
        return {"role": t.role, "content": _content_parts(t)}
    return {"role": t.role, "content": t.content}


def _results_images(turns: Sequence[Turn]) -> dict[str, Any] | None:
    """The images of a run of tool results, as the user message that follows the run."""
    parts = [attachment_part(a) for t in turns for a in t.attached()]
    return {"role": "user", "content": parts} if parts else None


def _plain(tool: dict[str, Any]) -> dict[str, Any]:
    """A function tool as Chat Completions takes it (a deferred tool is offered up front:
    the API has no deferral)."""
    return {k: v for k, v in tool.items() if k != "defer_loading"}


def _calls(message: dict[str, Any]) -> tuple[ToolCall, ...]:
    return tuple(
        ToolCall(str(c["id"]), str(fn["name"]), str(fn.get("arguments") or ""))
        for c in message.get("tool_calls") or []
        for fn in (c["function"],)
    )


# Anthropic's effort levels in OpenAI's terms
OPENAI_EFFORT = {"max": "xhigh"}


class OpenAIAdapter:
    provider = "openai"
    sees = True
    supports_cache_key = True
    takes_effort = True
    limit_field = "max_completion_tokens"

    def auth_headers(self, api_key: str) -> dict[str, str]:
        return {"authorization": f"Bearer {api_key}"}

    def render(self, call: ChatCall, cache: CacheDirectives) -> Rendered:
        if not self.sees:
            for i, t in enumerate(call.turns):
                if t.attached():
                    raise ProviderBadRequest(
                        self.provider, f"messages[{i}]: this provider takes no images or files"
                    )
        msgs: list[tuple[str, dict[str, Any]]] = []
        if call.system:
            msgs.append(("system", {"role": "system", "content": call.system}))
        if call.volatile_system:
            msgs.append(("system:volatile", {"role": "system", "content": call.volatile_system}))
        results: list[Turn] = []  # the run of tool results so far
        for i, t in enumerate(call.turns):
            if t.role != "tool" and results:
                images = _results_images(results)
                if images is not None:  # closes the run: counted in its last segment
                    msgs.append((f"message:{i - 1}", images))
                results = []
            if t.role == "tool":
                results.append(t)
            msgs.append((f"message:{i}", _message(t, call.tools)))
        images = _results_images(results)
        if images is not None:
            msgs.append((f"message:{len(call.turns) - 1}", images))
        tools = [_plain(t) for t in call.tools]
        prompt = b""
        ends: dict[str, int] = {}
        if tools:  # first in the prefix: a tool change invalidates everything after
            prompt += canonical_json(tools)
            ends["tools"] = len(prompt)
        for key, m in msgs:
            prompt += canonical_json(m)
            ends[key] = len(prompt)
        body: dict[str, Any] = {"model": call.model, "messages": [m for _, m in msgs]}
        if tools:
            body["tools"] = tools
        if call.tool_choice:
            body["tool_choice"] = call.tool_choice
        if call.max_tokens is not None:
            body[self.limit_field] = call.max_tokens
        if cache.cache_key and self.supports_cache_key:
            body["prompt_cache_key"] = cache.cache_key
        if cache.retention and self.supports_cache_key:
            body["prompt_cache_retention"] = cache.retention
        if call.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        for name, value in (
            ("temperature", call.temperature),
            ("top_p", call.top_p),
            ("seed", call.seed),
        ):
            if value is not None:
                body[name] = value
        if call.stop:
            body["stop"] = list(call.stop)
        effort = effective_effort(call.effort, (t.control for t in call.turns))
        if effort is not None and self.takes_effort:
            body["reasoning_effort"] = OPENAI_EFFORT.get(effort, effort)
        media = media_spans(
            prompt, call.turns, lambda a: image_tokens.openai(a.attachment.ref, a.detail)
        )
        return Rendered("/chat/completions", canonical_json(body), prompt, ends, call.stream, media)

    def usage(self, u: dict[str, Any]) -> ProviderUsage:
        details = u.get("prompt_tokens_details") or {}
        return ProviderUsage(
            int(u.get("prompt_tokens") or 0),
            int(details.get("cached_tokens") or 0),
            int(details.get("cache_write_tokens") or 0),
            int(u.get("completion_tokens") or 0),
        )

    def parse(self, body: Any) -> Answer:
        choice = body["choices"][0]
        text = choice["message"].get("content") or ""
        usage = self.usage(body.get("usage") or {})
        reason = choice.get("finish_reason") or "stop"
        return Answer(text, usage, reason, _calls(choice["message"]))

    def stream_parser(self) -> _StreamParser:
        return _StreamParser(self)


class DeepSeekAdapter(OpenAIAdapter):
    """OpenAI's wire format; caching is automatic (64-token units) and reported as
    ``prompt_cache_hit_tokens`` / ``prompt_cache_miss_tokens``."""

    provider = "deepseek"
    sees = False
    supports_cache_key = False
    takes_effort = False  # its reasoning model thinks as it does, with no knob
    limit_field = "max_tokens"

    def usage(self, u: dict[str, Any]) -> ProviderUsage:
        hit = int(u.get("prompt_cache_hit_tokens") or 0)
        miss = int(u.get("prompt_cache_miss_tokens") or 0)
        prompt = int(u.get("prompt_tokens") or hit + miss)
        return ProviderUsage(prompt, hit, 0, int(u.get("completion_tokens") or 0))


class _StreamParser:
    def __init__(self, adapter: OpenAIAdapter) -> None:
        self._adapter = adapter
        self._finish: str | None = None

    def feed(self, event: ServerSentEvent) -> list[Delta]:
        if not event.data or event.data == "[DONE]":
            return []
        data = json.loads(event.data)
        if "error" in data:
            raise ProviderUnavailable(self._adapter.provider, f"stream error: {data['error']}")
        out: list[Delta] = []
        for choice in data.get("choices") or []:
            delta = choice.get("delta") or {}
            text = delta.get("content") or ""
            parts = tuple(_part(c) for c in delta.get("tool_calls") or [])
            if text or parts:
                out.append(Delta(text=text, tool_calls=parts))
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
        if data.get("usage"):
            out.append(Delta(usage=self._adapter.usage(data["usage"]), finish_reason=self._finish))
        return out


def _part(c: dict[str, Any]) -> ToolCallPart:
    fn = c.get("function") or {}
    return ToolCallPart(int(c["index"]), c.get("id"), fn.get("name"), fn.get("arguments") or "")
