"""Anthropic's extended thinking, emulated: a request with ``thinking`` on gets a
thinking block first in its answer, signed; the signature proves, on the way back,
that a client relayed the block untouched.

The rules checked are Anthropic's: a thinking block sent back must carry the
signature it was answered with, and with thinking on, an assistant turn that
calls a tool (the turn a tool result answers) must start with its thinking
block.
"""

from __future__ import annotations

import hashlib
from typing import Any

KEY = b"vcache-emulator-thinking"


def signature(text: str) -> str:
    return hashlib.sha256(KEY + text.encode()).hexdigest()


def enabled(body: dict[str, Any]) -> bool:
    t = body.get("thinking")
    return isinstance(t, dict) and t.get("type") in ("enabled", "adaptive")


def problem(body: dict[str, Any]) -> str | None:
    """What Anthropic would refuse in the request's thinking blocks, or None."""
    messages = body.get("messages") or []
    for i, m in enumerate(messages):
        content = m.get("content")
        blocks = content if isinstance(content, list) else []
        for j, b in enumerate(blocks):
            if b.get("type") == "thinking" and b.get("signature") != signature(
                str(b.get("thinking", ""))
            ):
                return f"messages.{i}.content.{j}: Invalid `signature` in `thinking` block"
    if not enabled(body):
        return None
    for i, m in enumerate(messages):
        content = m.get("content")
        if m.get("role") != "assistant" or not isinstance(content, list) or not content:
            continue
        calls = any(b.get("type") == "tool_use" for b in content)
        if calls and content[0].get("type") not in ("thinking", "redacted_thinking"):
            return (
                f"messages.{i}.content.0.type: Expected `thinking` or `redacted_thinking`, "
                f"but found `{content[0].get('type')}`. When `thinking` is enabled, a final "
                "`assistant` message must start with a thinking block."
            )
    return None


def thought(raw: bytes) -> dict[str, Any]:
    """The thinking block of an answer to this request (deterministic per request)."""
    text = f"Thinking about request {hashlib.sha256(raw).hexdigest()[:12]} step by step."
    return {"type": "thinking", "thinking": text, "signature": signature(text)}
