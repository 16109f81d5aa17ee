"""What the gateway hands an adapter, and what comes back.

A :class:`ChatCall` is provider-neutral: a stable system prompt, an optional
volatile part of it, and user/assistant turns.  The :class:`CacheDirectives`
come from the planner: which segments end in a cache breakpoint (explicit
providers), the TTL, the ``prompt_cache_key``, a Gemini cached-content
handle, or a warm (``max_tokens: 0``).  The adapter returns a
:class:`Rendered` request whose ``prompt`` is the provider-ordered byte
string of the prompt blocks exactly as they appear in ``body``, with the
byte offset where each segment ends (render records hash these).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from engines.sse import ServerSentEvent


@dataclass(frozen=True)
class ToolCall:
    """A function call the model made: ``arguments`` is the JSON text of its arguments."""

    id: str
    name: str
    arguments: str

    def args(self) -> dict[str, Any]:
        """The arguments as an object, for providers that take objects (text that is not
        a JSON object is wrapped as ``{"arguments": ...}``)."""
        try:
            value = json.loads(self.arguments or "{}")
        except json.JSONDecodeError:
            value = self.arguments
        return value if isinstance(value, dict) else {"arguments": value}


@dataclass(frozen=True)
class Turn:
    role: str  # "user" | "assistant" | "tool"
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers
    thinking: tuple[Mapping[str, Any], ...] = ()  # an assistant's thinking blocks, as written


@dataclass(frozen=True)
class ChatCall:
    model: str  # the provider's model id
    turns: tuple[Turn, ...]
    system: str | None = None
    volatile_system: str | None = None
    tools: tuple[dict[str, Any], ...] = ()  # OpenAI function tools, in order
    # OpenAI's: "auto" | "none" | "required" | {"type": "function", "function": {"name"}}
    tool_choice: str | dict[str, Any] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    stream: bool = False
    thinking: Mapping[str, Any] | None = None  # Anthropic's extended thinking config

    def segment_keys(self) -> list[str]:
        """Segments in prefix order: tools → system → system:volatile → message:i."""
        keys = ["tools"] if self.tools else []
        if self.system:
            keys.append("system")
        if self.volatile_system:
            keys.append("system:volatile")
        return keys + [f"message:{i}" for i in range(len(self.turns))]


@dataclass(frozen=True)
class CacheDirectives:
    breakpoints: tuple[str, ...] = ()  # segment keys that end in a cache marker
    ttl_s: int = 300
    long_ttl: tuple[str, ...] = ()  # breakpoints that take the long tier (Anthropic 1h)
    cache_key: str | None = None
    cached_content: str | None = None  # Gemini: covers the system segment
    warm: bool = False  # prefill only (Anthropic max_tokens: 0)
    retention: str | None = None  # OpenAI prompt_cache_retention ("24h": extended caching)


@dataclass(frozen=True)
class Rendered:
    path: str  # relative to the provider's base URL
    body: bytes = field(repr=False)
    prompt: bytes = field(repr=False)  # the prompt blocks, in the provider's prefix order
    segment_ends: Mapping[str, int] = field(default_factory=dict)  # key → end offset in prompt
    stream: bool = False


@dataclass(frozen=True)
class ProviderUsage:
    """OpenAI's convention: ``prompt_tokens`` includes the cached ones."""

    prompt_tokens: int
    cached_tokens: int
    cache_write_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class ThinkingPart:
    """Part of a thinking block the model wrote: the first part of block ``index`` opens
    it (``redacted`` carries a redacted block's data whole); its text and signature may
    come in several parts.  Relayed to the client untouched, as the provider wants it
    back."""

    index: int
    text: str = ""
    signature: str = ""
    redacted: str | None = None


@dataclass(frozen=True)
class Answer:
    text: str
    usage: ProviderUsage
    finish_reason: str  # OpenAI's names: "stop" | "length" | "tool_calls"
    tool_calls: tuple[ToolCall, ...] = ()
    thinking: tuple[ThinkingPart, ...] = ()  # whole blocks, in order
    stop_sequence: str | None = None  # the client's stop sequence that ended it


@dataclass(frozen=True)
class ToolCallPart:
    """Part of a streamed tool call: the first part of call ``index`` carries its id and
    name; the arguments' JSON text may come in several parts."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class Delta:
    text: str = ""
    usage: ProviderUsage | None = None
    finish_reason: str | None = None
    tool_calls: tuple[ToolCallPart, ...] = ()
    thinking: tuple[ThinkingPart, ...] = ()
    stop_sequence: str | None = None


def forced_tool(choice: str | dict[str, Any] | None) -> str | None:
    """The function a named ``tool_choice`` forces, if it names one."""
    if isinstance(choice, dict):
        fn = choice.get("function")
        return str(fn["name"]) if isinstance(fn, dict) and "name" in fn else None
    return None


class StreamParser(Protocol):
    def feed(self, event: ServerSentEvent) -> list[Delta]: ...


class Adapter(Protocol):
    provider: str

    def auth_headers(self, api_key: str) -> dict[str, str]: ...

    def render(self, call: ChatCall, cache: CacheDirectives) -> Rendered: ...

    def parse(self, body: Any) -> Answer: ...

    def stream_parser(self) -> StreamParser: ...


def error_message(body: Any) -> str:
    """The message of an error body; every provider nests it as ``{"error": {"message"}}``."""
    err = body.get("error") if isinstance(body, dict) else None
    return str(err.get("message")) if isinstance(err, dict) else str(body)[:200]
