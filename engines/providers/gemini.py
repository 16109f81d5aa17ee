"""Gemini ``generateContent``: implicit caching, or an explicit ``cachedContents`` handle.

Images and documents travel as ``inlineData`` parts (their media type and the base64
of the bytes as received) where they sit in their turn; a tool result's follow its
``functionResponse`` in the same content."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from engines.base import call_id
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
    base64_of,
    forced_tool,
    media_spans,
    system_text,
)
from engines.providers.errors import ProviderUnavailable
from engines.sse import ServerSentEvent
from manifest.canonical import canonical_json

_FINISH = {"STOP": "stop", "MAX_TOKENS": "length"}


def _usage(u: dict[str, Any]) -> ProviderUsage:
    return ProviderUsage(
        int(u.get("promptTokenCount") or 0),
        int(u.get("cachedContentTokenCount") or 0),
        0,
        int(u.get("candidatesTokenCount") or 0),
    )


def _declaration(t: dict[str, Any]) -> dict[str, Any]:
    fn = t["function"]
    out: dict[str, Any] = {"name": fn["name"]}
    if fn.get("description"):
        out["description"] = fn["description"]
    if fn.get("parameters"):
        out["parameters"] = fn["parameters"]
    return out


def _content(role: str, text: str) -> dict[str, Any]:
    return {"role": "model" if role == "assistant" else "user", "parts": [{"text": text}]}


def inline_part(a: Attached) -> dict[str, Any]:
    """An image or a document as an ``inlineData`` part, bytes as received."""
    ref = a.attachment.ref
    return {"inlineData": {"mimeType": ref.media_type, "data": base64_of(a.attachment)}}


def _parts(t: Turn) -> list[dict[str, Any]]:
    """A turn's parts in order (empty text left out)."""
    return [
        inline_part(p) if isinstance(p, Attached) else {"text": p}
        for p in t.parts
        if isinstance(p, Attached) or p
    ]


def _tool_config(choice: str | dict[str, Any]) -> dict[str, Any]:
    """OpenAI's ``tool_choice`` as Gemini's function-calling mode."""
    name = forced_tool(choice)
    if name is not None:
        return {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": [name]}}
    mode = {"auto": "AUTO", "none": "NONE", "required": "ANY"}[str(choice)]
    return {"functionCallingConfig": {"mode": mode}}


def _response(content: str) -> dict[str, Any]:
    """A tool's result as a ``functionResponse.response`` object."""
    try:
        value = json.loads(content)
    except json.JSONDecodeError:
        value = None
    return value if isinstance(value, dict) else {"content": content}


def _turn_content(
    t: Turn, names: dict[str, str], tools: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    """A turn as a content: an assistant's calls are ``functionCall`` parts after its text,
    a tool's result a user ``functionResponse`` part naming the function it answers; a
    system message after the first turn (Gemini has one system instruction, up front) a
    user turn that says what it was."""
    if t.role == "system":
        return _content("user", f"[system] {system_text(t, tools)}")
    if t.role == "tool":
        name = names.get(t.tool_call_id or "", "")
        part = {"functionResponse": {"name": name, "response": _response(system_text(t, tools))}}
        return {"role": "user", "parts": [part, *(inline_part(a) for a in t.attached())]}
    if t.parts:
        return {"role": "model" if t.role == "assistant" else "user", "parts": _parts(t)}
    if not t.tool_calls:
        return _content(t.role, t.content)
    parts: list[dict[str, Any]] = [{"text": t.content}] if t.content else []
    for c in t.tool_calls:
        names[c.id] = c.name
        args = c.args()
        parts.append(
            {
                "functionCall": {
                    "name": c.name,
                    "args": args if isinstance(args, dict) else {"arguments": args},
                }
            }
        )
    return {"role": "model", "parts": parts}


def _is_responses(content: dict[str, Any]) -> bool:
    return content["role"] == "user" and "functionResponse" in content["parts"][0]


def _calls(parts: list[dict[str, Any]]) -> list[ToolCall]:
    return [
        ToolCall(str(fc.get("id") or call_id()), str(fc["name"]), json.dumps(fc.get("args") or {}))
        for p in parts
        if (fc := p.get("functionCall"))
    ]


class GeminiAdapter:
    provider = "gemini"

    def auth_headers(self, api_key: str) -> dict[str, str]:
        return {"x-goog-api-key": api_key}

    def render(self, call: ChatCall, cache: CacheDirectives) -> Rendered:
        """With a cached-content handle, the handle stands for the system segment (a
        request naming one may not set ``systemInstruction``), and the volatile
        system part travels as the first user content."""
        prompt = b""
        ends: dict[str, int] = {}
        body: dict[str, Any] = {}
        contents: list[dict[str, Any]] = []
        if call.tools:  # never with a cached-content handle: the gateway does not make one
            decls = [_declaration(t) for t in call.tools]
            body["tools"] = [{"functionDeclarations": decls}]
            prompt += canonical_json(body["tools"])
            ends["tools"] = len(prompt)
            if call.tool_choice:
                body["toolConfig"] = _tool_config(call.tool_choice)
        if cache.cached_content:
            body["cachedContent"] = cache.cached_content
            if call.system:
                prompt += canonical_json({"cachedContent": cache.cached_content})
                ends["system"] = len(prompt)
            if call.volatile_system:
                contents.append(_content("user", call.volatile_system))
                prompt += canonical_json(contents[-1])
                ends["system:volatile"] = len(prompt)
        else:
            parts = []
            if call.system:
                parts.append({"text": call.system})
                prompt += canonical_json(parts[-1])
                ends["system"] = len(prompt)
            if call.volatile_system:
                parts.append({"text": call.volatile_system})
                prompt += canonical_json(parts[-1])
                ends["system:volatile"] = len(prompt)
            if parts:
                body["systemInstruction"] = {"parts": parts}
        names: dict[str, str] = {}  # tool call id → function name
        for i, t in enumerate(call.turns):
            content = _turn_content(t, names, call.tools)
            prompt += canonical_json(content)
            ends[f"message:{i}"] = len(prompt)
            if contents and _is_responses(content) and _is_responses(contents[-1]):
                # parallel calls' responses travel in one content
                contents[-1] = {**contents[-1], "parts": contents[-1]["parts"] + content["parts"]}
            else:
                contents.append(content)
        body["contents"] = contents
        config: dict[str, Any] = {}
        for name, value in (
            ("maxOutputTokens", call.max_tokens),
            ("temperature", call.temperature),
            ("topP", call.top_p),
            ("seed", call.seed),
        ):
            if value is not None:
                config[name] = value
        if call.stop:
            config["stopSequences"] = list(call.stop)
        if config:
            body["generationConfig"] = config
        action = "streamGenerateContent?alt=sse" if call.stream else "generateContent"
        path = f"/models/{call.model}:{action}"
        media = media_spans(prompt, call.turns, lambda a: image_tokens.gemini(a.attachment.ref))
        return Rendered(path, canonical_json(body), prompt, ends, call.stream, media)

    def render_cache(self, call: ChatCall, ttl_s: int) -> Rendered:
        """``POST /cachedContents`` holding the system segment (the anchor)."""
        part = {"text": call.system or ""}
        body = {
            "model": f"models/{call.model}",
            "systemInstruction": {"parts": [part]},
            "ttl": f"{ttl_s}s",
        }
        prompt = canonical_json(part)
        return Rendered("/cachedContents", canonical_json(body), prompt, {"system": len(prompt)})

    def parse(self, body: Any) -> Answer:
        cand = (body.get("candidates") or [{}])[0]
        parts = (cand.get("content") or {}).get("parts", [])
        text = "".join(p.get("text", "") for p in parts)
        calls = tuple(_calls(parts))
        finish = "tool_calls" if calls else _FINISH.get(str(cand.get("finishReason")), "stop")
        return Answer(text, _usage(body.get("usageMetadata") or {}), finish, calls)

    def stream_parser(self) -> _StreamParser:
        return _StreamParser()


class _StreamParser:
    def __init__(self) -> None:
        self._usage: dict[str, Any] = {}
        self._calls = 0

    def feed(self, event: ServerSentEvent) -> list[Delta]:
        if not event.data:
            return []
        data = json.loads(event.data)
        if "error" in data:
            raise ProviderUnavailable("gemini", f"stream error: {data['error']}")
        out: list[Delta] = []
        self._usage = data.get("usageMetadata") or self._usage
        cand = (data.get("candidates") or [{}])[0]
        parts = (cand.get("content") or {}).get("parts", [])
        text = "".join(p.get("text", "") for p in parts)
        calls = tuple(
            ToolCallPart(self._calls + i, c.id, c.name, c.arguments)
            for i, c in enumerate(_calls(parts))
        )
        self._calls += len(calls)
        if text or calls:
            out.append(Delta(text=text, tool_calls=calls))
        if cand.get("finishReason"):
            reason = _FINISH.get(str(cand["finishReason"]), "stop")
            reason = "tool_calls" if self._calls and reason == "stop" else reason
            out.append(Delta(usage=_usage(self._usage), finish_reason=reason))
        return out
