"""Anthropic Messages API (``POST /v1/messages``) with prompt caching.

Rules modelled (from Anthropic's prompt-caching documentation):

- the prompt is ordered tools → system → messages; ``cache_control``
  (``{"type": "ephemeral", "ttl": "5m"|"1h"}``) on a block marks a breakpoint;
  at most 4 breakpoints, and a 1h breakpoint may not follow a 5m one;
- a breakpoint writes the prefix through its block, unless that prefix is
  shorter than the model's minimum cacheable length;
- reads: at each breakpoint the cache is checked there and at up to 20 earlier
  block boundaries (the lookback); a read refreshes the entry's TTL;
- usage: ``input_tokens`` (after the last breakpoint),
  ``cache_creation_input_tokens`` (with the 5m/1h split in ``cache_creation``)
  and ``cache_read_input_tokens``;
- ``max_tokens: 0`` prefills only (a warm), and is refused with streaming;
- ``image`` and ``document`` blocks (base64 sources, also inside a ``tool_result``)
  count by Anthropic's image rule (:mod:`.media`), and their bytes are part of the
  cache key: a prefix through an image is read only when the image is identical.
"""

from __future__ import annotations

import hashlib
import itertools
import json
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
    sse,
    state_of,
)
from .limits import RuleOverride
from .media import BadMedia, Weigher
from .state import PrefixStore, compact, tokens
from .thinking import enabled as thinking_enabled
from .thinking import problem as thinking_problem
from .thinking import thought
from .tools import Function, ToolUse, tool_use

router = APIRouter()

MIN_PREFIX = {
    "claude-opus-4": 4096,
    "claude-haiku-4-5": 4096,
    "claude-3-haiku": 2048,
    "claude-sonnet": 1024,
}
DEFAULT_MIN_PREFIX = 1024
LOOKBACK_BLOCKS = 20
MAX_BREAKPOINTS = 4
TTLS = {"5m": 300.0, "1h": 3600.0}

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


def error(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _TYPES.get(status, "api_error"), "message": message}}


def min_prefix(model: str) -> int:
    return next((v for k, v in MIN_PREFIX.items() if model.startswith(k)), DEFAULT_MIN_PREFIX)


class BadRequest(Exception):
    pass


@dataclass
class Block:
    data: bytes
    ttl: str | None  # the breakpoint's TTL, None when the block carries no cache_control
    weight: int | None = None  # its tokens when it carries an image (else 4 bytes a token)

    def tokens(self) -> int:
        return self.weight if self.weight is not None else tokens(self.data + b"\n")


def _strip(block: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    cc = block.get("cache_control")
    rest = {k: v for k, v in block.items() if k != "cache_control"}
    if cc is None:
        return rest, None
    if not isinstance(cc, dict) or cc.get("type") != "ephemeral":
        raise BadRequest("cache_control.type: Input should be 'ephemeral'")
    ttl = cc.get("ttl", "5m")
    if ttl not in TTLS:
        raise BadRequest("cache_control.ttl: Input should be '5m' or '1h'")
    return rest, ttl


def blocks_of(body: dict[str, Any], weigher: Weigher | None = None) -> list[Block]:
    """The prompt's blocks in order; with a weigher, an image's counted by its rule."""
    out: list[Block] = []
    for tool in body.get("tools") or []:
        rest, ttl = _strip(tool)
        out.append(Block(b"tool:" + compact(rest), ttl))
    system = body.get("system")
    if isinstance(system, str):
        out.append(Block(b"system:" + compact({"type": "text", "text": system}), None))
    elif isinstance(system, list):
        for b in system:
            rest, ttl = _strip(b)
            out.append(Block(b"system:" + compact(rest), ttl))
    for m in body["messages"]:
        role = str(m.get("role")).encode()
        content = m.get("content")
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(parts, list) or not parts:
            raise BadRequest("messages: each message needs content")
        for p in parts:
            rest, ttl = _strip(p)
            head = role + b":"
            weight = weigher.weight(head, rest) if weigher is not None else None
            out.append(Block(head + compact(rest), ttl, weight))
    return out


@dataclass
class CacheUsage:
    input_tokens: int
    read: int
    write_5m: int
    write_1h: int

    def fields(self) -> dict[str, Any]:
        return {
            "input_tokens": self.input_tokens,
            "cache_creation_input_tokens": self.write_5m + self.write_1h,
            "cache_read_input_tokens": self.read,
            "cache_creation": {
                "ephemeral_5m_input_tokens": self.write_5m,
                "ephemeral_1h_input_tokens": self.write_1h,
            },
        }


def apply_cache(
    store: PrefixStore,
    model: str,
    blocks: list[Block],
    rules: RuleOverride | None = None,
) -> CacheUsage:
    """Read, then write, the breakpoints of one request; returns its usage split."""
    rules = rules or RuleOverride()
    ttls = {"5m": rules.ttl_s or TTLS["5m"], "1h": rules.ttl_long_s or TTLS["1h"]}
    bps = [i for i, b in enumerate(blocks) if b.ttl is not None]
    if len(bps) > MAX_BREAKPOINTS:
        raise BadRequest(
            f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. "
            f"Found {len(bps)}."
        )
    if any(blocks[a].ttl == "5m" and blocks[b].ttl == "1h" for a, b in itertools.pairwise(bps)):
        raise BadRequest("a ttl='1h' cache_control block must not come after a ttl='5m' block")
    h = hashlib.sha256(model.encode() + b"\0")
    keys: list[bytes] = []
    cum: list[int] = []
    total = 0
    for b in blocks:
        h.update(b.data + b"\n")
        keys.append(h.copy().digest())
        total += b.tokens()
        cum.append(total)
    minimum = rules.min_prefix or min_prefix(model)
    read = 0
    for bp in bps:
        for j in range(bp, max(-1, bp - LOOKBACK_BLOCKS), -1):
            if cum[j] > read and store.read(keys[j]) is not None:
                read = cum[j]
                break
    writes = {"5m": 0, "1h": 0}
    covered = read
    for bp in bps:
        if cum[bp] < minimum:
            continue
        ttl = blocks[bp].ttl or "5m"
        if cum[bp] > covered:
            writes[ttl] += cum[bp] - covered
            covered = cum[bp]
        store.write(keys[bp], cum[bp], ttls[ttl])
    return CacheUsage(total - covered, read, writes["5m"], writes["1h"])


def _validate(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if not isinstance(body.get("model"), str):
        raise BadRequest("model: Field required")
    mt = body.get("max_tokens")
    if not isinstance(mt, int) or mt < 0:
        raise BadRequest("max_tokens: Field required (a non-negative integer)")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("messages: at least one message is required")
    if mt == 0:
        choice = (body.get("tool_choice") or {}).get("type")
        if body.get("stream") or body.get("thinking") or choice in ("any", "tool"):
            raise BadRequest(
                "max_tokens: 0 cannot be combined with stream, thinking or a forced tool_choice"
            )
    return body


def _tool_uses(body: dict[str, Any], raw: bytes) -> list[ToolUse]:
    functions = [
        Function(str(t["name"]), t.get("input_schema") or {})
        for t in body.get("tools") or []
        if "name" in t and t.get("type") in (None, "custom")
    ]
    tc = body.get("tool_choice") or {"type": "auto"}
    choice = str(tc["name"]) if tc.get("type") == "tool" else str(tc.get("type", "auto"))
    last = body["messages"][-1]
    content = last.get("content")
    answered = (
        last.get("role") == "user"
        and isinstance(content, list)
        and any(b.get("type") == "tool_result" for b in content)
    )
    parallel = not tc.get("disable_parallel_tool_use")
    return tool_use(functions, choice, answered, raw, parallel)


def _check_results(messages: list[dict[str, Any]]) -> None:
    """Anthropic's check: each ``tool_result`` answers a ``tool_use`` of the message before."""
    uses: set[str] = set()
    for i, m in enumerate(messages):
        content = m.get("content")
        blocks = content if isinstance(content, list) else []
        for b in blocks:
            if b.get("type") == "tool_result" and str(b.get("tool_use_id")) not in uses:
                raise BadRequest(
                    f"messages.{i}.content: unexpected `tool_use_id` found in `tool_result` "
                    f"blocks: {b.get('tool_use_id')}. Each `tool_result` block must have a "
                    "corresponding `tool_use` block in the previous message."
                )
        uses = {str(b.get("id")) for b in blocks if b.get("type") == "tool_use"}


@router.post("/v1/messages", response_model=None)
async def messages(request: Request) -> Response:
    state = state_of(request)
    raw, body = await parse_json(request, "anthropic")
    if not check_key(state, request.headers.get("x-api-key")):
        return JSONResponse(error(401, "invalid x-api-key"), 401)
    if not request.headers.get("anthropic-version"):
        return JSONResponse(error(400, "anthropic-version: header is required"), 400)
    stream = isinstance(body, dict) and bool(body.get("stream"))
    early, cut = await fault_response(state, "anthropic", error, stream)
    if early is not None:
        return early
    try:
        body = _validate(body)
        _check_results(body["messages"])
        refused = thinking_problem(body)
        if refused is not None:
            raise BadRequest(refused)
        weigher = Weigher("anthropic")
        blocks = blocks_of(body, weigher)
        state.media += weigher.seen
        limited = rate_limited(state, "anthropic", sum(b.tokens() for b in blocks), error)
        if limited is not None:
            return limited
        store = state.store("anthropic").shard(b"")
        usage = apply_cache(store, body["model"], blocks, state.rule("anthropic"))
    except (BadRequest, BadMedia, KeyError, TypeError, AttributeError) as exc:
        return JSONResponse(error(400, str(exc) or "invalid request"), 400)
    n = answer_length(state, body["max_tokens"])
    uses = _tool_uses(body, raw) if n else []
    words = [] if uses else reply_words(raw, n)
    stop = "max_tokens" if n == body["max_tokens"] else "end_turn"
    calls = [
        {
            "type": "tool_use",
            "id": f"toolu_{uuid.uuid4().hex[:24]}",
            "name": u.name,
            "input": u.args,
        }
        for u in uses
    ]
    if calls:
        stop = "tool_use"
    thinking = [thought(raw)] if n and thinking_enabled(body) else []
    output = len(words) + sum(tokens(compact(u.args)) for u in uses)
    state.bill("anthropic").add(
        usage.input_tokens, usage.read, usage.write_5m, usage.write_1h, output
    )
    headers = state.limit_headers("anthropic")
    msg_id = f"msg_{uuid.uuid4().hex[:24]}"
    if not stream:
        return JSONResponse(
            {
                "id": msg_id,
                "type": "message",
                "role": "assistant",
                "model": body["model"],
                "content": thinking
                + ([{"type": "text", "text": "".join(words)}] if words else [])
                + calls,
                "stop_reason": stop,
                "stop_sequence": None,
                "usage": {**usage.fields(), "output_tokens": output},
            },
            headers=headers,
        )

    async def events() -> AsyncIterator[bytes]:
        start = {
            "id": msg_id,
            "type": "message",
            "role": "assistant",
            "model": body["model"],
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {**usage.fields(), "output_tokens": 1},
        }
        yield sse({"type": "message_start", "message": start}, "message_start")
        yield sse({"type": "ping"}, "ping")
        index = 0
        for t in thinking:
            deltas = [
                {"type": "thinking_delta", "thinking": t["thinking"]},
                {"type": "signature_delta", "signature": t["signature"]},
            ]
            for e in _block(index, {"type": "thinking", "thinking": "", "signature": ""}, deltas):
                yield e
            index += 1
        if words or not calls:
            for e in _text_block(index, words):
                yield e
            index += 1
        for call in calls:
            for e in _tool_block(index, call):
                yield e
            index += 1
        yield sse(
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop, "stop_sequence": None},
                "usage": {"output_tokens": output},
            },
            "message_delta",
        )
        yield sse({"type": "message_stop"}, "message_stop")

    return event_stream(cut_after(events(), cut), headers)


def _block(index: int, start: dict[str, Any], deltas: list[dict[str, Any]]) -> list[bytes]:
    """One content block's events: start, deltas, stop."""
    out = [
        sse(
            {"type": "content_block_start", "index": index, "content_block": start},
            "content_block_start",
        )
    ]
    out += [
        sse({"type": "content_block_delta", "index": index, "delta": d}, "content_block_delta")
        for d in deltas
    ]
    out.append(sse({"type": "content_block_stop", "index": index}, "content_block_stop"))
    return out


def _text_block(index: int, words: list[str]) -> list[bytes]:
    deltas = [{"type": "text_delta", "text": w} for w in words]
    return _block(index, {"type": "text", "text": ""}, deltas)


def _tool_block(index: int, call: dict[str, Any]) -> list[bytes]:
    """A ``tool_use`` block: its input streamed as JSON text in two parts."""
    text = json.dumps(call["input"])
    half = len(text) // 2
    deltas = [{"type": "input_json_delta", "partial_json": p} for p in (text[:half], text[half:])]
    return _block(index, {**call, "input": {}}, deltas)
