"""What the gateway hands an adapter, and what comes back.

A :class:`ChatCall` is provider-neutral: a stable system prompt, an optional
volatile part of it, and user/assistant turns.  The :class:`CacheDirectives`
come from the planner: which segments end in a cache breakpoint (explicit
providers), the TTL, the ``prompt_cache_key``, a Gemini cached-content
handle, or a warm (``max_tokens: 0``).  The adapter returns a
:class:`Rendered` request whose ``prompt`` is the provider-ordered byte
string of the prompt blocks exactly as they appear in ``body``, with the
byte offset where each segment ends (render records hash these).

A turn that carries images or documents has them in ``Turn.parts`` as
:class:`Attached` values, bytes included; every adapter writes those bytes as
received (base64 of the exact bytes, where they sit among the text), and its
``prompt`` holds them as its body does, so a prefix is credited only up to the
first image whose bytes changed.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from engines.sse import ServerSentEvent
from manifest.attachments import Attachment
from manifest.attachments import data_url as url_of


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
class Attached:
    """An image or a document inside a turn, with its bytes: every adapter sends the
    bytes exactly as the client sent them (re-encoding would change them, and with them
    the provider's cache key)."""

    attachment: Attachment
    detail: str | None = None  # an image's OpenAI ``detail`` (low, high, auto), as sent
    title: str | None = None  # a document's title (Anthropic) or file name (OpenAI)


@dataclass(frozen=True)
class Turn:
    role: str  # "user" | "assistant" | "tool" | "system" (a system message where it sits)
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers
    thinking: tuple[Mapping[str, Any], ...] = ()  # an assistant's thinking blocks, as written
    # a system turn's tool changes (Anthropic's tool_addition / tool_removal), as written
    tool_changes: tuple[Mapping[str, Any], ...] = ()
    # the message's own output control (Anthropic's per-turn output_config), as written
    control: Mapping[str, Any] | None = None
    # a message that carries images or documents: its content in order, text as str and
    # each attachment where it sits (``content`` is then its text alone); () otherwise
    parts: tuple[str | Attached, ...] = ()

    def attached(self) -> tuple[Attached, ...]:
        """The turn's images and documents, in order."""
        return tuple(p for p in self.parts if isinstance(p, Attached))


def base64_of(a: Attachment) -> str:
    """The attachment's exact bytes in base64 (never decoded, never re-encoded)."""
    return base64.b64encode(a.data).decode("ascii")


def data_url(a: Attachment) -> str:
    """The attachment's exact bytes as a ``data:`` URL."""
    return url_of(a.ref.media_type, a.data)


def document_text(a: Attachment) -> str:
    """A text/plain document's text (intake has checked it is UTF-8)."""
    return a.data.decode("utf-8")


def effective_effort(
    effort: str | None, controls: Iterable[Mapping[str, Any] | None]
) -> str | None:
    """The effort in force for the answer: the last message's own (``controls``, each
    message's per-turn control in order) where one set it, else the request's."""
    for control in reversed(list(controls)):
        own = (control or {}).get("output_config", {}).get("effort")
        if own is not None:
            return str(own)
    return effort


def _tool_named(tools: Sequence[Mapping[str, Any]], name: str) -> Mapping[str, Any] | None:
    for t in tools:
        if t.get("function", {}).get("name") == name:
            return t
    return None


def _defined(definition: Mapping[str, Any]) -> dict[str, Any]:
    """An Anthropic tool definition (``tool_definition``) as an OpenAI function tool."""
    fn: dict[str, Any] = {"name": definition.get("name", "")}
    if definition.get("description"):
        fn["description"] = definition["description"]
    fn["parameters"] = definition.get("input_schema") or {"type": "object", "properties": {}}
    return {"type": "function", "function": fn}


def _ref_name(ref: Mapping[str, Any]) -> str:
    name = str(ref.get("name") or "")
    server = ref.get("server_name")
    if server and name:
        return f"{server}/{name}"
    return name or str(server or "")


def tool_change_text(
    changes: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]
) -> str:
    """A system message's tool changes as text, for a model (or a provider) that takes the
    tools it may call only up front: each added tool's definition as the tool list has it
    (a reference resolved against ``tools``, the request's), each removed tool by name.
    One rule for every request, so the text is the same wherever the message recurs."""
    out: list[str] = []
    for block in changes:
        ref = block.get("tool") or {}
        if block.get("type") == "tool_reference":  # a tool search's find: an addition
            ref = {"type": "tool_reference", "name": block.get("tool_name", "")}
            block = {"type": "tool_addition", "tool": ref}
        kind = ref.get("type")
        if block.get("type") == "tool_addition":
            if kind == "tool_definition":
                spec: Any = _defined(ref.get("definition") or {})
            else:
                name = str(ref.get("name", ""))
                found = _tool_named(tools, name) if kind == "tool_reference" else None
                spec = {k: v for k, v in found.items() if k != "defer_loading"} if found else None
            body = json.dumps(spec, ensure_ascii=False) if spec is not None else _ref_name(ref)
            out.append(f"<tool_added>\n{body}\n</tool_added>")
        elif block.get("type") == "tool_removal":
            out.append(f"<tool_removed>{_ref_name(ref)}</tool_removed>")
    return "\n".join(out)


def system_text(t: Turn, tools: Sequence[Mapping[str, Any]]) -> str:
    """A turn's text with its tool changes (a system message's additions and removals, a
    tool search's finds) written after it."""
    changes = tool_change_text(t.tool_changes, tools)
    if not changes:
        return t.content
    return f"{t.content}\n\n{changes}" if t.content else changes


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
    effort: str | None = None  # how hard to think (OpenAI reasoning_effort, Anthropic's)
    # Anthropic's context_management, as the client sent it (its own targets only)
    context_management: Mapping[str, Any] | None = None
    safeguards: Sequence[Mapping[str, Any]] | None = None  # Anthropic's, as sent

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
class MediaSpan:
    """Where an image's (or a document's) base64 sits in a render's ``prompt``, and the
    tokens the provider counts for it (:mod:`engines.providers.image_tokens`), which
    its bytes are no measure of."""

    start: int
    end: int
    tokens: int
    digest: str = ""  # the attachment's sha256: what a read that breaks inside it names


def media_spans(
    prompt: bytes, turns: Sequence[Turn], weigh: Callable[[Attached], int]
) -> tuple[MediaSpan, ...]:
    """Each attachment's base64 in ``prompt``, in order (an adapter renders them in turn
    order), weighed by ``weigh``; one an adapter wrote otherwise (a text document as
    its text) is text, and not a span."""
    out: list[MediaSpan] = []
    cursor = 0
    for t in turns:
        for a in t.attached():
            needle = base64_of(a.attachment).encode("ascii")
            at = prompt.find(needle, cursor)
            if at < 0:
                continue
            cursor = at + len(needle)
            out.append(MediaSpan(at, cursor, weigh(a), a.attachment.ref.digest))
    return tuple(out)


def estimate_tokens(end: int, media: Sequence[MediaSpan]) -> int:
    """The tokens of ``prompt[:end]``: text at 4 bytes a token, each image in it as the
    provider counts it."""
    text, images = end, 0
    for s in media:
        if s.start >= end:
            break
        text -= min(s.end, end) - s.start
        if s.end <= end:
            images += s.tokens
    return -(-text // 4) + images


@dataclass(frozen=True)
class Rendered:
    path: str  # relative to the provider's base URL
    body: bytes = field(repr=False)
    prompt: bytes = field(repr=False)  # the prompt blocks, in the provider's prefix order
    segment_ends: Mapping[str, int] = field(default_factory=dict)  # key → end offset in prompt
    stream: bool = False
    media: tuple[MediaSpan, ...] = ()  # the images in ``prompt``, as the provider counts them


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
