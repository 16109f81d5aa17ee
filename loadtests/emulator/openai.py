"""OpenAI Chat Completions and Responses, and DeepSeek's chat completions (under ``/deepseek``).

Rules modelled:

- OpenAI: automatic prefix caching from 1024 tokens in 128-token steps; the
  cache shard is chosen by a hash of the first 256 tokens with
  ``prompt_cache_key``, so requests sharing a prefix but not a key may land
  on different shards; ``prompt_cache_retention`` ``in_memory`` (5 minutes
  of inactivity) or ``24h``; usage ``prompt_tokens_details.cached_tokens``
  (chat) and ``input_tokens_details.cached_tokens`` (responses).
- DeepSeek: caching on by default in 64-token units, one shard; usage
  ``prompt_cache_hit_tokens`` / ``prompt_cache_miss_tokens``.
- images (``image_url`` data URLs with ``detail``, ``file`` parts; the Responses
  API's ``input_image`` / ``input_file``) count by OpenAI's tile rule
  (:mod:`.media`) and are cached only on identical bytes and ``detail``; DeepSeek
  takes none (a 400).

A request's cache entries are written once its response begins.
"""

from __future__ import annotations

import json
import time
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

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error"}


def error(status: int, message: str) -> dict[str, Any]:
    code = {401: "invalid_api_key", 429: "rate_limit_exceeded"}.get(status)
    kind = _TYPES.get(status, "rate_limit_error" if status == 429 else "server_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


@dataclass(frozen=True)
class Rules:
    provider: str
    minimum: int
    step: int
    sharded: bool
    ttl_s: float
    ttl_long_s: float = 86400.0  # OpenAI's prompt_cache_retention: 24h


OPENAI = Rules("openai", 1024, 128, True, 300.0)
DEEPSEEK = Rules("deepseek", 64, 64, False, 3600.0)
ROUTE_TOKENS = 256


@dataclass
class Cached:
    prompt: int
    cached: int


def effective(state: EmulatorState, rules: Rules) -> Rules:
    """The documented rules with what the operator set (and did not tell clients)."""
    o = state.rule(rules.provider)
    return Rules(
        rules.provider,
        o.min_prefix or rules.minimum,
        o.granularity or rules.step,
        rules.sharded,
        o.ttl_s or rules.ttl_s,
        o.ttl_long_s or rules.ttl_long_s,
    )


def _cache(
    state: EmulatorState, rules: Rules, model: str, stream: TokenStream, key: str, ttl_s: float
) -> Cached:
    total = stream.total
    cuts = list(range(rules.minimum, total + 1, rules.step))
    keys = stream.keys(model.encode() + b"\0", cuts)
    head = stream.data[: stream.byte_end(ROUTE_TOKENS)]
    route = head + b"\0" + key.encode() if rules.sharded else b""
    shard = state.store(rules.provider).shard(route)
    hit = implicit_lookup(shard, keys)
    implicit_write(shard, keys, ttl_s)  # readable by the next request, not this one
    return Cached(total, hit)


def _pieces(heads: list[tuple[bytes, Any]], weigher: Weigher | None) -> TokenStream:
    """Each (head, value) as the piece ``head + compact(value) + "\n"``, weighed where it
    carries media."""
    return TokenStream(
        [Piece(h + compact(v) + b"\n", weigher.weight(h, v) if weigher else None) for h, v in heads]
    )


def chat_stream(body: dict[str, Any], weigher: Weigher | None = None) -> TokenStream:
    parts = [(b"tool:", t) for t in body.get("tools") or []]
    parts += [(b"msg:", m) for m in body["messages"]]
    return _pieces(parts, weigher)


def chat_stream_bytes(body: dict[str, Any]) -> bytes:
    return chat_stream(body).data


def _ttl(rules: Rules, body: dict[str, Any]) -> float:
    return rules.ttl_long_s if body.get("prompt_cache_retention") == "24h" else rules.ttl_s


def _usage(rules: Rules, c: Cached, completion: int) -> dict[str, Any]:
    u: dict[str, Any] = {
        "prompt_tokens": c.prompt,
        "completion_tokens": completion,
        "total_tokens": c.prompt + completion,
    }
    if rules.provider == "deepseek":
        u["prompt_cache_hit_tokens"] = c.cached
        u["prompt_cache_miss_tokens"] = c.prompt - c.cached
    else:
        u["prompt_tokens_details"] = {"cached_tokens": c.cached, "audio_tokens": 0}
        u["completion_tokens_details"] = {"reasoning_tokens": 0}
    return u


def _tool_uses(body: dict[str, Any], raw: bytes) -> list[ToolUse]:
    functions = [
        Function(str(t["function"]["name"]), t["function"].get("parameters") or {})
        for t in body.get("tools") or []
        if t.get("type") == "function"
    ]
    choice = body.get("tool_choice", "auto")
    if isinstance(choice, dict):
        choice = str(choice["function"]["name"])
    elif choice == "required":
        choice = "any"
    answered = body["messages"][-1].get("role") == "tool"
    parallel = body.get("parallel_tool_calls", True) is not False
    return tool_use(functions, choice, answered, raw, parallel)


def _unanswerable(messages: list[dict[str, Any]]) -> str | None:
    """OpenAI's check: a tool message answers a call of the assistant message before it."""
    calls: set[str] = set()
    for m in messages:
        if m.get("role") == "assistant":
            calls = {str(c.get("id")) for c in m.get("tool_calls") or []}
        elif m.get("role") == "tool" and str(m.get("tool_call_id")) not in calls:
            return (
                "Invalid parameter: messages with role 'tool' must be a response to a "
                "preceeding message with 'tool_calls'."
            )
    return None


async def _chat(request: Request, documented: Rules) -> Response:
    state = state_of(request)
    rules = effective(state, documented)
    raw, body = await parse_json(request, rules.provider)
    auth = request.headers.get("authorization", "")
    if not auth.startswith("Bearer ") or not check_key(state, auth[7:]):
        return JSONResponse(error(401, "Incorrect API key provided"), 401)
    stream = isinstance(body, dict) and bool(body.get("stream"))
    early, cut = await fault_response(state, rules.provider, error, stream)
    if early is not None:
        return early
    if not isinstance(body, dict) or not isinstance(body.get("model"), str):
        return JSONResponse(error(400, "you must provide a model parameter"), 400)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        return JSONResponse(error(400, "messages: must be a non-empty array"), 400)
    bad = _unanswerable(msgs)
    if bad is not None:
        return JSONResponse(error(400, bad), 400)
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    n = answer_length(state, limit)
    key = str(body.get("prompt_cache_key") or "")
    weigher = Weigher(rules.provider)
    try:
        prompt = chat_stream(body, weigher)
    except BadMedia as exc:
        return JSONResponse(error(400, str(exc)), 400)
    if weigher.seen and rules.provider == "deepseek":
        return JSONResponse(error(400, "unknown variant `image_url`, expected `text`"), 400)
    state.media += weigher.seen
    limited = rate_limited(state, rules.provider, prompt.total, error)
    if limited is not None:
        return limited
    c = _cache(state, rules, body["model"], prompt, key, _ttl(rules, body))
    uses = _tool_uses(body, raw)
    words = [] if uses else reply_words(raw, n)
    finish = "length" if limit is not None and n == int(limit) else "stop"
    calls: list[dict[str, Any]] = [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": u.name, "arguments": json.dumps(u.args)},
        }
        for u in uses
    ]
    if calls:
        finish = "tool_calls"
    cid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
    out_tokens = len(words) + sum(tokens(compact(u.args)) for u in uses)
    usage = _usage(rules, c, out_tokens)
    state.bill(rules.provider).add(c.prompt - c.cached, c.cached, 0, 0, out_tokens)
    headers = state.limit_headers(rules.provider)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(words) or None}
    if calls:
        message["tool_calls"] = calls
    else:
        message["content"] = "".join(words)
    if not stream:
        return JSONResponse(
            {
                "id": cid,
                "object": "chat.completion",
                "created": created,
                "model": body["model"],
                "choices": [
                    {
                        "index": 0,
                        "message": message,
                        "finish_reason": finish,
                    }
                ],
                "usage": usage,
            },
            headers=headers,
        )
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

    def chunk(delta: dict[str, Any], reason: str | None = None) -> bytes:
        return sse(
            {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": body["model"],
                "choices": [{"index": 0, "delta": delta, "finish_reason": reason}],
            }
        )

    async def events() -> AsyncIterator[bytes]:
        yield chunk({"role": "assistant", "content": None if calls else ""})
        for w in words:
            yield chunk({"content": w})
        for i, call in enumerate(calls):  # the name first, the arguments in two parts
            fn = call["function"]
            head = {**call, "index": i, "function": {"name": fn["name"], "arguments": ""}}
            yield chunk({"tool_calls": [head]})
            half = len(fn["arguments"]) // 2
            for part in (fn["arguments"][:half], fn["arguments"][half:]):
                yield chunk({"tool_calls": [{"index": i, "function": {"arguments": part}}]})
        yield chunk({}, finish)
        if include_usage:
            yield sse(
                {
                    "id": cid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": body["model"],
                    "choices": [],
                    "usage": usage,
                }
            )
        yield b"data: [DONE]\n\n"

    return event_stream(cut_after(events(), cut), headers)


@router.post("/v1/chat/completions", response_model=None)
async def openai_chat(request: Request) -> Response:
    return await _chat(request, OPENAI)


@router.post("/deepseek/chat/completions", response_model=None)
async def deepseek_chat(request: Request) -> Response:
    return await _chat(request, DEEPSEEK)


def responses_stream(body: dict[str, Any], weigher: Weigher | None = None) -> TokenStream:
    parts = [(b"tool:", t) for t in body.get("tools") or []]
    if body.get("instructions"):
        parts.append((b"msg:", {"role": "system", "content": body["instructions"]}))
    inp = body.get("input")
    items = [{"role": "user", "content": inp}] if isinstance(inp, str) else list(inp or [])
    parts += [(b"msg:", i) for i in items]
    return _pieces(parts, weigher)


def responses_stream_bytes(body: dict[str, Any]) -> bytes:
    return responses_stream(body).data


@router.post("/v1/responses", response_model=None)
async def responses(request: Request) -> Response:
    state = state_of(request)
    raw, body = await parse_json(request, "openai")
    auth = request.headers.get("authorization", "")
    if not auth.startswith("Bearer ") or not check_key(state, auth[7:]):
        return JSONResponse(error(401, "Incorrect API key provided"), 401)
    stream = isinstance(body, dict) and bool(body.get("stream"))
    early, cut = await fault_response(state, "openai", error, stream)
    if early is not None:
        return early
    if not isinstance(body, dict) or not isinstance(body.get("model"), str):
        return JSONResponse(error(400, "you must provide a model parameter"), 400)
    if not body.get("input"):
        return JSONResponse(error(400, "input: required"), 400)
    limit = body.get("max_output_tokens")
    n = answer_length(state, limit)
    key = str(body.get("prompt_cache_key") or "")
    rules = effective(state, OPENAI)
    weigher = Weigher("openai")
    try:
        prompt = responses_stream(body, weigher)
    except BadMedia as exc:
        return JSONResponse(error(400, str(exc)), 400)
    state.media += weigher.seen
    limited = rate_limited(state, "openai", prompt.total, error)
    if limited is not None:
        return limited
    c = _cache(state, rules, body["model"], prompt, key, _ttl(rules, body))
    state.bill("openai").add(c.prompt - c.cached, c.cached, 0, 0, n)
    done = response_object(body["model"], "".join(reply_words(raw, n)), c.prompt, c.cached, n)
    if not stream:
        return JSONResponse(done)

    async def events() -> AsyncIterator[bytes]:
        created = {**done, "status": "in_progress", "output": [], "usage": None}
        yield sse({"type": "response.created", "response": created}, "response.created")
        for w in reply_words(raw, n):
            yield sse(
                {"type": "response.output_text.delta", "output_index": 0, "delta": w},
                "response.output_text.delta",
            )
        yield sse({"type": "response.completed", "response": done}, "response.completed")

    return event_stream(cut_after(events(), cut))


def response_object(model: str, text: str, prompt: int, cached: int, n: int) -> dict[str, Any]:
    """A completed Responses API ``response``: one message of ``text``, its usage (``n``
    output tokens, ``cached`` of ``prompt`` read from cache).  Online and in a batch."""
    return {
        "id": f"resp_{uuid.uuid4().hex[:24]}",
        "object": "response",
        "created_at": int(time.time()),
        "status": "completed",
        "model": model,
        "output": [
            {
                "type": "message",
                "id": f"msg_{uuid.uuid4().hex[:24]}",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        ],
        "usage": {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": n,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + n,
        },
    }
