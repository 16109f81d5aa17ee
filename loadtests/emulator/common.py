"""Pieces every provider route shares: auth, faults, deterministic text, SSE framing."""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .state import EmulatorState, Fault

ErrorBody = Callable[[int, str], dict[str, Any]]

_WORDS = (
    "cache prefix token block warm anchor replica model stream byte "
    "hit miss write read ledger belief plan route shard layout"
).split()


def state_of(request: Request) -> EmulatorState:
    s: EmulatorState = request.app.state.emulator
    return s


def answer_length(state: EmulatorState, limit: Any) -> int:
    """Words in an answer: the emulator's answer length, cut to the request's output
    limit (``None``: no limit asked)."""
    return state.answer_words if limit is None else min(int(limit), state.answer_words)


def reply_words(body: bytes, n: int) -> list[str]:
    """``n`` words chosen by the request body's digest: the same request, the same text."""
    seed = hashlib.sha256(body).digest()
    out: list[str] = []
    while len(out) < n:
        seed = hashlib.sha256(seed).digest()
        out += [_WORDS[b % len(_WORDS)] for b in seed[: n - len(out)]]
    return [w if i == 0 else " " + w for i, w in enumerate(out)]


def sse(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + json.dumps(data).encode() + b"\n\n"


async def parse_json(request: Request, provider: str) -> tuple[bytes, Any]:
    body = await request.body()
    state_of(request).log(provider, request.url.path, body)
    try:
        return body, json.loads(body)
    except json.JSONDecodeError:
        return body, None


def rate_limited(
    state: EmulatorState, provider: str, n_tokens: int, error: ErrorBody
) -> Response | None:
    """A 429 in the provider's format when the request is over its rate limit."""
    wait = state.admit(provider, n_tokens)
    if wait is None:
        return None
    headers = {"retry-after": str(max(1, math.ceil(wait))), **state.limit_headers(provider)}
    return JSONResponse(error(429, "rate limit exceeded"), 429, headers=headers)


def check_key(state: EmulatorState, key: str | None) -> bool:
    if not key:
        return False
    return state.api_key is None or key == state.api_key


async def fault_response(
    state: EmulatorState, provider: str, error: ErrorBody, stream: bool
) -> tuple[Response | None, Fault | None]:
    """Apply the next queued fault: an error response, a stall, a drop, or a later cut.

    Returns the response to send instead (if any) and a ``cut`` fault the
    stream must apply itself.
    """
    fault = state.take_fault(provider)
    if fault is None:
        return None, None
    if fault.kind == "status":
        headers: dict[str, str] = {}
        if fault.retry_after is not None:
            headers["retry-after"] = fault.retry_after
        if fault.retry_after_ms is not None:
            headers["retry-after-ms"] = str(fault.retry_after_ms)
        return (
            JSONResponse(error(fault.status, "injected fault"), fault.status, headers=headers),
            None,
        )
    if fault.kind == "timeout":
        await asyncio.sleep(fault.delay_s)
        return None, None
    if fault.kind == "garbage":  # a 2xx whose body no client can read
        if stream:
            events = [b'data: {"choices": "not a list", "type": "message_start"}\n\n']
            return StreamingResponse(_replay(events), media_type="text/event-stream"), None
        return JSONResponse({"id": 7, "choices": None, "content": "?", "candidates": 3}), None
    if fault.kind == "drop":
        return StreamingResponse(_dropped(), media_type="application/json"), None
    if fault.kind == "cut" and stream:
        return None, fault
    return None, None


async def _replay(chunks: list[bytes]) -> AsyncIterator[bytes]:
    for c in chunks:
        yield c


async def _dropped() -> AsyncIterator[bytes]:
    raise ConnectionAbortedError("injected: connection dropped")
    yield b""  # pragma: no cover - makes this an async generator


async def cut_after(events: AsyncIterator[bytes], fault: Fault | None) -> AsyncIterator[bytes]:
    """Pass ``events`` through; with a cut fault, drop the connection after some of them."""
    sent = 0
    async for e in events:
        if fault is not None and sent >= fault.after_events:
            raise ConnectionAbortedError("injected: stream cut")
        yield e
        sent += 1


def event_stream(
    events: AsyncIterator[bytes], headers: dict[str, str] | None = None
) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)


async def opened(
    request: Request,
    provider: str,
    path: str,
    auth: Callable[[Request], Response | None],
    error: ErrorBody,
    not_json: str,
) -> tuple[EmulatorState, Any] | Response:
    """A create request's state and JSON body, once its key passed (``auth``), it is
    logged and no queued fault answers it; else the answer to give (a bad body: a 400
    saying ``not_json``)."""
    refused = auth(request)
    if refused is not None:
        return refused
    state = state_of(request)
    raw = await request.body()
    state.log(provider, path, raw)
    early, _ = await fault_response(state, provider, error, False)
    if early is not None:
        return early
    try:
        return state, json.loads(raw)
    except json.JSONDecodeError:
        return JSONResponse(error(400, not_json), 400)
