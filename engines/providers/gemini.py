"""Gemini ``generateContent``: implicit caching, or an explicit ``cachedContents`` handle."""

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
                mode = {"auto": "AUTO", "none": "NONE"}[call.tool_choice]
                body["toolConfig"] = {"functionCallingConfig": {"mode": mode}}
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
        for i, t in enumerate(call.turns):
            contents.append(_content(t.role, t.content))
            prompt += canonical_json(contents[-1])
            ends[f"message:{i}"] = len(prompt)
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
        return Rendered(path, canonical_json(body), prompt, ends, call.stream)

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
        text = "".join(p.get("text", "") for p in (cand.get("content") or {}).get("parts", []))
        finish = _FINISH.get(str(cand.get("finishReason")), "stop")
        return Answer(text, _usage(body.get("usageMetadata") or {}), finish)

    def stream_parser(self) -> _StreamParser:
        return _StreamParser()


class _StreamParser:
    def __init__(self) -> None:
        self._usage: dict[str, Any] = {}

    def feed(self, event: ServerSentEvent) -> list[Delta]:
        if not event.data:
            return []
        data = json.loads(event.data)
        if "error" in data:
            raise ProviderUnavailable("gemini", f"stream error: {data['error']}")
        out: list[Delta] = []
        self._usage = data.get("usageMetadata") or self._usage
        cand = (data.get("candidates") or [{}])[0]
        text = "".join(p.get("text", "") for p in (cand.get("content") or {}).get("parts", []))
        if text:
            out.append(Delta(text=text))
        if cand.get("finishReason"):
            reason = _FINISH.get(str(cand["finishReason"]), "stop")
            out.append(Delta(usage=_usage(self._usage), finish_reason=reason))
        return out
