"""Gemini ``generateContent`` / ``streamGenerateContent`` and ``cachedContents``.

Rules modelled (Gemini API caching documentation):

- implicit caching from a per-model minimum (2048 tokens for Flash, 4096 for
  Pro), at content boundaries, reported as ``cachedContentTokenCount``;
- explicit ``cachedContents``: created with ``ttl`` (default 1 hour) or
  ``expireTime``, refused below the model's minimum; a request that names
  one pays its tokens as cached and may not also set ``systemInstruction``,
  ``tools`` or ``toolConfig``; an expired or deleted one is ``NOT_FOUND``;
- ``inlineData`` images count 258 tokens each (per 768-pixel tile beyond 384
  pixels, :mod:`.media`), cached only on identical bytes.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from .common import (
    answer_length,
    check_key,
    cut_after,
    event_stream,
    fault_response,
    parse_json,
    rate_limited,
    reply_words,
    state_of,
)
from .media import BadMedia, Weigher
from .state import (
    EmulatorState,
    Piece,
    TokenStream,
    compact,
    implicit_lookup,
    implicit_write,
    tokens,
)
from .tools import Function, ToolUse, tool_use

router = APIRouter()

MIN_PREFIX = {"gemini-2.5-pro": 4096, "gemini-3": 4096}  # every Gemini 3.x model
DEFAULT_MIN_PREFIX = 2048
IMPLICIT_TTL_S = 300.0
DEFAULT_EXPLICIT_TTL_S = 3600.0
_STATUS = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    429: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
    503: "UNAVAILABLE",
}


def error(status: int, message: str) -> dict[str, Any]:
    return {"error": {"code": status, "message": message, "status": _STATUS.get(status, "UNKNOWN")}}


def min_prefix(model: str) -> int:
    return next((v for k, v in MIN_PREFIX.items() if model.startswith(k)), DEFAULT_MIN_PREFIX)


def pieces_of(body: dict[str, Any], weigher: Weigher | None = None) -> list[Piece]:
    """The prompt's items in order; with a weigher, an image's counted by its rule."""
    out: list[tuple[bytes, Any]] = [(b"tool:", t) for t in body.get("tools") or []]
    if body.get("systemInstruction"):
        out.append((b"system:", body["systemInstruction"]))
    out += [(b"content:", c) for c in body.get("contents") or []]
    return [
        Piece(h + compact(v) + b"\n", weigher.weight(h, v) if weigher else None) for h, v in out
    ]


def items_of(body: dict[str, Any]) -> list[bytes]:
    return [p.data for p in pieces_of(body)]


def _tool_uses(body: dict[str, Any], raw: bytes) -> list[ToolUse]:
    functions = [
        Function(str(d["name"]), d.get("parameters") or {})
        for t in body.get("tools") or []
        for d in t.get("functionDeclarations") or []
    ]
    cfg = (body.get("toolConfig") or {}).get("functionCallingConfig") or {}
    mode = str(cfg.get("mode", "AUTO")).lower()
    allowed = cfg.get("allowedFunctionNames") or []
    choice = str(allowed[0]) if mode == "any" and len(allowed) == 1 else mode
    parts = body["contents"][-1].get("parts") or []
    answered = any("functionResponse" in p for p in parts)
    return tool_use(functions, choice, answered, raw, parallel=True)


def _unmatched(contents: list[dict[str, Any]]) -> str | None:
    """Gemini's check: a turn of function responses answers every call of the turn before."""
    calls = 0
    for c in contents:
        parts = c.get("parts") or []
        responses = sum("functionResponse" in p for p in parts)
        if responses and responses != calls:
            return (
                "Please ensure that the number of function response parts is equal to the "
                "number of function call parts of the function call turn."
            )
        calls = sum("functionCall" in p for p in parts)
    return None


@dataclass
class CachedContent:
    name: str
    model: str
    stream: bytes
    tokens: int
    expires: float  # emulator clock
    display_name: str

    def resource(self, state: EmulatorState) -> dict[str, Any]:
        left = self.expires - state.clock.now()
        expire = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=left)
        return {
            "name": self.name,
            "model": f"models/{self.model}",
            "displayName": self.display_name,
            "expireTime": expire.isoformat().replace("+00:00", "Z"),
            "usageMetadata": {"totalTokenCount": self.tokens},
        }


def _key_ok(request: Request) -> bool:
    key = request.headers.get("x-goog-api-key") or request.query_params.get("key")
    return check_key(state_of(request), key)


def _ttl_s(body: dict[str, Any]) -> float:
    ttl = body.get("ttl")
    if ttl is None:
        return DEFAULT_EXPLICIT_TTL_S
    if not isinstance(ttl, str) or not ttl.endswith("s"):
        raise ValueError("ttl: a duration like '3600s'")
    return float(ttl[:-1])


def _live(state: EmulatorState, name: str) -> CachedContent | None:
    cc: CachedContent | None = state.gemini_cached.get(name)
    if cc is not None and cc.expires <= state.clock.now():
        del state.gemini_cached[name]
        return None
    return cc


@router.post("/v1beta/cachedContents", response_model=None)
async def create_cached(request: Request) -> Response:
    state = state_of(request)
    _, body = await parse_json(request, "gemini")
    if not _key_ok(request):
        return JSONResponse(error(401, "API key not valid"), 401)
    early, _ = await fault_response(state, "gemini", error, False)
    if early is not None:
        return early
    if not isinstance(body, dict) or not isinstance(body.get("model"), str):
        return JSONResponse(error(400, "model: required"), 400)
    model = body["model"].removeprefix("models/")
    try:
        ttl = _ttl_s(body)
    except ValueError as exc:
        return JSONResponse(error(400, str(exc)), 400)
    weigher = Weigher("gemini")
    try:
        held = TokenStream(pieces_of(body, weigher))
    except BadMedia as exc:
        return JSONResponse(error(400, str(exc)), 400)
    state.media += weigher.seen
    stream, n = held.data, held.total
    if n < min_prefix(model):
        msg = (
            f"Cached content is too small. total_token_count={n}, "
            f"min_total_token_count={min_prefix(model)}"
        )
        return JSONResponse(error(400, msg), 400)
    name = f"cachedContents/{uuid.uuid4().hex[:16]}"
    cc = CachedContent(
        name, model, stream, n, state.clock.now() + ttl, str(body.get("displayName", ""))
    )
    state.gemini_cached[name] = cc
    return JSONResponse(cc.resource(state))


@router.get("/v1beta/cachedContents/{cid}", response_model=None)
async def get_cached(cid: str, request: Request) -> Response:
    state = state_of(request)
    if not _key_ok(request):
        return JSONResponse(error(401, "API key not valid"), 401)
    cc = _live(state, f"cachedContents/{cid}")
    if cc is None:
        return JSONResponse(error(404, "CachedContent not found (or permission denied)"), 404)
    return JSONResponse(cc.resource(state))


@router.delete("/v1beta/cachedContents/{cid}", response_model=None)
async def delete_cached(cid: str, request: Request) -> Response:
    state = state_of(request)
    state.log("gemini", request.url.path, b"")
    if not _key_ok(request):
        return JSONResponse(error(401, "API key not valid"), 401)
    if state.gemini_cached.pop(f"cachedContents/{cid}", None) is None:
        return JSONResponse(error(404, "CachedContent not found (or permission denied)"), 404)
    return JSONResponse({})


@router.post("/v1beta/models/{model_action}", response_model=None)
async def generate(model_action: str, request: Request) -> Response:
    state = state_of(request)
    raw, body = await parse_json(request, "gemini")
    model, _, action = model_action.partition(":")
    if action not in ("generateContent", "streamGenerateContent"):
        return JSONResponse(error(404, f"unknown method {action!r}"), 404)
    if not _key_ok(request):
        return JSONResponse(error(401, "API key not valid"), 401)
    stream = action == "streamGenerateContent"
    early, cut = await fault_response(state, "gemini", error, stream)
    if early is not None:
        return early
    if not isinstance(body, dict) or not body.get("contents"):
        return JSONResponse(error(400, "contents: required"), 400)
    bad = _unmatched(body["contents"])
    if bad is not None:
        return JSONResponse(error(400, bad), 400)
    cached = 0
    prefix = b""
    if body.get("cachedContent"):
        if any(body.get(k) for k in ("systemInstruction", "tools", "toolConfig")):
            msg = (
                "CachedContent can not be used with GenerateContent request setting "
                "system_instruction, tools or tool_config."
            )
            return JSONResponse(error(400, msg), 400)
        cc = _live(state, str(body["cachedContent"]))
        if cc is None:
            return JSONResponse(error(404, "CachedContent not found (or permission denied)"), 404)
        if cc.model != model:
            return JSONResponse(error(400, "the cached content is for another model"), 400)
        prefix, cached = cc.stream, cc.tokens
    weigher = Weigher("gemini")
    try:
        items = pieces_of(body, weigher)
    except BadMedia as exc:
        return JSONResponse(error(400, str(exc)), 400)
    state.media += weigher.seen
    # a cached content's stream comes first, its tokens as counted when it was made
    held = Piece(prefix, None if cached == tokens(prefix) else cached)
    prompt = TokenStream([held, *items])
    total = prompt.total
    limited = rate_limited(state, "gemini", total, error)
    if limited is not None:
        return limited
    rules = state.rule("gemini")
    minimum = rules.min_prefix or min_prefix(model)
    if not cached:
        cuts = [end for end in prompt.ends() if end >= minimum]
        keys = prompt.keys(model.encode() + b"\0", cuts)
        shard = state.store("gemini").shard(b"")
        cached = implicit_lookup(shard, keys)
        implicit_write(shard, keys, rules.ttl_s or IMPLICIT_TTL_S)
    limit = (body.get("generationConfig") or {}).get("maxOutputTokens")
    n = answer_length(state, limit)
    uses = _tool_uses(body, raw)
    words = [] if uses else reply_words(raw, n)
    finish = "MAX_TOKENS" if limit is not None and n == int(limit) and not uses else "STOP"
    calls = [{"functionCall": {"name": u.name, "args": u.args}} for u in uses]
    called = sum(tokens(compact(u.args)) for u in uses)
    state.bill("gemini").add(total - cached, cached, 0, 0, len(words) + called)

    def usage(out: int) -> dict[str, Any]:
        u = {"promptTokenCount": total, "candidatesTokenCount": out, "totalTokenCount": total + out}
        if cached:
            u["cachedContentTokenCount"] = cached
        return u

    def answer(
        text: str, out: int, reason: str | None, tools: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        parts = tools if tools else [{"text": text}]
        cand: dict[str, Any] = {"content": {"role": "model", "parts": parts}, "index": 0}
        if reason:
            cand["finishReason"] = reason
        return {"candidates": [cand], "usageMetadata": usage(out), "modelVersion": model}

    if not stream:
        return JSONResponse(answer("".join(words), len(words) + called, finish, calls))

    async def events() -> AsyncIterator[bytes]:
        if calls:  # a function call comes whole, in one chunk
            yield b"data: " + compact(answer("", called, finish, calls)) + b"\r\n\r\n"
            return
        for i, w in enumerate(words):
            last = i == len(words) - 1
            data = compact(answer(w, i + 1, finish if last else None))
            yield b"data: " + data + b"\r\n\r\n"
        if not words:
            yield b"data: " + compact(answer("", 0, finish)) + b"\r\n\r\n"

    return event_stream(cut_after(events(), cut))
