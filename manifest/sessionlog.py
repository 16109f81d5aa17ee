"""The session log's event model (shared/seeds/000): append-only, folded into requests.

A session is a sequence of events:

- :class:`HeaderEvent` — a snapshot of what frames every request: the model
  asked for, the target, the leading system prompt(s), the tool schemas and
  the call config; reason ``initial``, ``resume`` or ``change``.  Empty
  values are canonicalized to absent, so ``[]``, ``{}``, ``""`` and ``None``
  never make two snapshots differ.
- :class:`MessageEvent` — one conversation entry after the system prompt; one that
  carries images or documents keeps its content in order as ``parts`` (text, and a
  reference to each attachment by digest with its recorded metadata: never the
  bytes, which live in the attachments store, :mod:`manifest.attachments`).  A text
  completion's prompt (one engine request of ``/v1/completions``, or a cache warm
  named by a prompt) is the one entry of its conversation: role ``prompt`` (its
  text) or ``prompt_tokens`` (its token ids, as canonical JSON), see
  :func:`prompt_entry`; its dispatch's ``prompt`` directive says how it became
  the ids vLLM was handed.
- :class:`ReplaceEvent` / :class:`TruncateEvent` — an entry replaced (a
  trimmed tool result) or the history cut back; never an edit in place.
- :class:`DispatchEvent` — a request sent: target, kind (``provider`` or
  ``vllm``), the render inputs that are not conversation (cache directives,
  resolved sampling) and the sha256 of what was sent.
- :class:`ResponseEvent` — the usage and cache telemetry of an answer.

:func:`fold` turns a prefix of the log into the state a request is rendered
from; rendering itself (bytes for a provider, token ids for vLLM) belongs to
the adapters, so the same fold rebuilds what was sent.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

from manifest.attachments import AttachmentRef
from manifest.canonical import canonical_json

BLOB_MIN_BYTES = 256  # shorter strings (ids, digests, short turns) stay inline


class Reason(StrEnum):
    INITIAL = "initial"
    RESUME = "resume"
    CHANGE = "change"


def _absent(value: Any) -> bool:
    return value is None or value == "" or value == [] or value == {} or value == ()


def canonical_config(config: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """Sorted items with empty values dropped; lists become tuples (hashable, stable)."""
    return tuple(
        (k, tuple(v) if isinstance(v, list) else v)
        for k, v in sorted(config.items())
        if not _absent(v)
    )


@dataclass(frozen=True)
class Header:
    model: str
    target: str
    system: tuple[str, ...] = ()
    tools: str | None = None  # canonical JSON of the tool schemas
    config: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def make(
        cls,
        model: str,
        target: str,
        system: Sequence[str] = (),
        tools: Sequence[Mapping[str, Any]] | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> Header:
        return cls(
            model,
            target,
            tuple(system),
            None if _absent(tools) else canonical_json(list(tools or [])).decode(),
            canonical_config(config or {}),
        )

    def settings(self) -> dict[str, Any]:
        return dict(self.config)

    def tool_list(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = json.loads(self.tools) if self.tools else []
        return out


@dataclass(frozen=True)
class HeaderEvent:
    header: Header
    reason: Reason
    kind: Literal["header"] = "header"


@dataclass(frozen=True)
class MessageEvent:
    role: str
    content: str
    name: str | None = None
    kind: Literal["message"] = "message"
    tool_calls: str | None = None  # an assistant's tool calls, as canonical JSON
    tool_call_id: str | None = None  # a tool result's call
    # an assistant's thinking blocks (with their signatures), as canonical JSON: relayed
    # to the provider that wrote them exactly as it wrote them
    thinking: str | None = None
    # a system message's tool changes (Anthropic's tool_addition / tool_removal blocks),
    # as canonical JSON: rendered where the message sits
    tool_changes: str | None = None
    # a message's own output control (Anthropic's per-turn ``output_config``), as
    # canonical JSON: in effect from this message on
    control: str | None = None
    # a message that carries images or documents: its content in order (text parts and
    # attachment references, :func:`parts_json`), as canonical JSON; ``content`` is then
    # its text alone
    parts: str | None = None

    def key(self) -> tuple[str | None, ...]:
        """What identifies the message in a conversation: its fields in groups, in the
        order the log came to record them, up to the last group with a value.  The groups
        after it (all None) are left off, so a message without tool calls, thinking, tool
        changes, a control or attachments keeps the key, and the digest, it always had."""
        groups: tuple[tuple[str | None, ...], ...] = (
            (self.role, self.content, self.name),
            (self.tool_calls, self.tool_call_id),
            (self.thinking,),
            (self.tool_changes, self.control),
            (self.parts,),
        )
        last = max(i for i, g in enumerate(groups) if i == 0 or any(v is not None for v in g))
        return tuple(v for g in groups[: last + 1] for v in g)


@dataclass(frozen=True)
class PartRef:
    """An attachment where it sits in a message: the stored object's reference, an
    image's OpenAI ``detail`` and a document's title (file name), as sent, and the
    client's ``uuid`` for an image (vLLM's extension: the image's cache identifier)."""

    ref: AttachmentRef
    detail: str | None = None
    title: str | None = None
    uuid: str | None = None


def parts_json(parts: Sequence[str | PartRef]) -> str:
    """A message's content in order as the log keeps it (canonical JSON): each text as
    ``{"type": "text", "text"}``, each attachment as ``{"type": "image" | "document",
    digest, media_type, size, width?, height?, detail?, title?, uuid?}``."""
    out: list[dict[str, Any]] = []
    for p in parts:
        if isinstance(p, str):
            out.append({"type": "text", "text": p})
            continue
        d: dict[str, Any] = {"type": p.ref.kind, **p.ref.as_json()}
        if p.detail is not None:
            d["detail"] = p.detail
        if p.title is not None:
            d["title"] = p.title
        if p.uuid is not None:
            d["uuid"] = p.uuid
        out.append(d)
    return canonical_json(out).decode()


def parts_of(m: MessageEvent) -> tuple[str | PartRef, ...]:
    """The content in order that :func:`parts_json` wrote into ``m.parts`` (() when the
    message carries no attachment); a ValueError for a part it never writes."""
    if m.parts is None:
        return ()
    out: list[str | PartRef] = []
    for d in json.loads(m.parts):
        kind = d.get("type")
        if kind == "text":
            out.append(str(d["text"]))
        elif kind in ("image", "document"):
            ref = AttachmentRef.from_json(d)
            if ref.kind != kind:
                raise ValueError(f"a {kind} part naming a {ref.media_type} object")
            out.append(PartRef(ref, d.get("detail"), d.get("title"), d.get("uuid")))
        else:
            raise ValueError(f"a message part of type {kind!r}")
    return tuple(out)


PROMPT_TEXT = "prompt"  # a text completion's prompt, as text
PROMPT_TOKENS = "prompt_tokens"  # a text completion's prompt, as token ids


def prompt_entry(prompt: str | Sequence[int]) -> MessageEvent:
    """A text completion's prompt as the one entry of its conversation: its text, or its
    token ids as canonical JSON (its own role, so a text that looks like ids, or a chat
    turn with the same text, is never the same entry)."""
    if isinstance(prompt, str):
        return MessageEvent(PROMPT_TEXT, prompt)
    return MessageEvent(PROMPT_TOKENS, canonical_json(list(prompt)).decode())


def entry_prompt(m: MessageEvent) -> str | list[int]:
    """The prompt :func:`prompt_entry` made ``m`` of; a ValueError for any other entry."""
    if m.role == PROMPT_TEXT:
        return m.content
    if m.role == PROMPT_TOKENS:
        ids: object = json.loads(m.content)
        if not isinstance(ids, list) or not all(type(t) is int for t in ids):
            raise ValueError("a prompt_tokens entry that is not a list of token ids")
        return [int(t) for t in ids]
    raise ValueError(f"a {m.role!r} entry is not a text completion's prompt")


@dataclass(frozen=True)
class ReplaceEvent:
    index: int
    message: MessageEvent
    kind: Literal["replace"] = "replace"


@dataclass(frozen=True)
class TruncateEvent:
    length: int
    kind: Literal["truncate"] = "truncate"


@dataclass(frozen=True)
class DispatchEvent:
    request_id: str
    target: str
    render: Literal["provider", "vllm"]
    directives: tuple[tuple[str, Any], ...]
    sha256: str
    kind: Literal["dispatch"] = "dispatch"
    # how the request found its session: named, found (by prefix digests) or new (None:
    # logs written before it was kept)
    session_kind: str | None = None

    def settings(self) -> dict[str, Any]:
        return dict(self.directives)


@dataclass(frozen=True)
class ResponseEvent:
    request_id: str
    usage: tuple[tuple[str, Any], ...] = ()
    response_id: str | None = None
    kind: Literal["response"] = "response"


Event = HeaderEvent | MessageEvent | ReplaceEvent | TruncateEvent | DispatchEvent | ResponseEvent


def attachment_refs(events: Iterable[Event]) -> dict[str, AttachmentRef]:
    """The attachment objects ``events`` reference, by digest (what retention keeps)."""
    out: dict[str, AttachmentRef] = {}
    for e in events:
        m = e.message if isinstance(e, ReplaceEvent) else e
        if isinstance(m, MessageEvent) and m.parts is not None:
            out.update((p.ref.digest, p.ref) for p in parts_of(m) if isinstance(p, PartRef))
    return out


@dataclass(frozen=True)
class State:
    header: Header | None = None
    messages: tuple[MessageEvent, ...] = ()
    last_dispatch: DispatchEvent | None = None


def fold(events: Iterable[Event]) -> State:
    """The state after ``events``: the current header and conversation."""
    header: Header | None = None
    messages: list[MessageEvent] = []
    last: DispatchEvent | None = None
    for e in events:
        if isinstance(e, HeaderEvent):
            header = e.header
        elif isinstance(e, MessageEvent):
            messages.append(e)
        elif isinstance(e, ReplaceEvent):
            if not 0 <= e.index < len(messages):
                raise ValueError(f"replace of entry {e.index} in a history of {len(messages)}")
            messages[e.index] = e.message
        elif isinstance(e, TruncateEvent):
            if not 0 <= e.length <= len(messages):
                raise ValueError(f"truncate to {e.length} in a history of {len(messages)}")
            del messages[e.length :]
        elif isinstance(e, DispatchEvent):
            last = e
    return State(header, tuple(messages), last)


def changes(state: State, header: Header, messages: Sequence[MessageEvent]) -> list[Event]:
    """The events that take ``state`` to ``header`` + ``messages``: a header snapshot when
    it differs, then replaces, a truncation or appended entries (never a rewrite)."""
    out: list[Event] = []
    if state.header is None:
        out.append(HeaderEvent(header, Reason.INITIAL))
    elif state.header != header:
        out.append(HeaderEvent(header, Reason.CHANGE))
    old = state.messages
    common = min(len(old), len(messages))
    for i in range(common):
        if old[i].key() != messages[i].key():
            out.append(ReplaceEvent(i, messages[i]))
    if len(messages) < len(old):
        out.append(TruncateEvent(len(messages)))
    out += list(messages[len(old) :])
    return out


# ------------------------------------------------------------------ encoding


@dataclass
class Encoded:
    data: bytes  # canonical JSON of the event, long strings replaced by {"$blob": sha256}
    blobs: dict[str, bytes] = field(default_factory=dict)


def _blob_out(value: Any, blobs: dict[str, bytes]) -> Any:
    if isinstance(value, str):
        # UTF-8 spends at most 4 bytes a character: a string this short is inline
        # whatever it holds, without encoding it (most of an event's strings are)
        if len(value) * 4 < BLOB_MIN_BYTES:
            return value
        data = value.encode()
        if len(data) < BLOB_MIN_BYTES:
            return value
        digest = hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return {"$blob": digest}
    if isinstance(value, dict):
        return {k: _blob_out(v, blobs) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_blob_out(v, blobs) for v in value]
    return value


def _as_dict(event: Event) -> dict[str, Any]:
    if isinstance(event, HeaderEvent):
        h = event.header
        return {
            "kind": "header",
            "reason": event.reason.value,
            "model": h.model,
            "target": h.target,
            "system": list(h.system),
            "tools": h.tools,
            "config": [list(kv) for kv in h.config],
        }
    if isinstance(event, MessageEvent):
        out: dict[str, Any] = {
            "kind": "message",
            "role": event.role,
            "content": event.content,
            "name": event.name,
        }
        if event.tool_calls is not None:
            out["tool_calls"] = event.tool_calls
        if event.tool_call_id is not None:
            out["tool_call_id"] = event.tool_call_id
        if event.thinking is not None:
            out["thinking"] = event.thinking
        if event.tool_changes is not None:
            out["tool_changes"] = event.tool_changes
        if event.control is not None:
            out["control"] = event.control
        if event.parts is not None:
            out["parts"] = event.parts
        return out
    if isinstance(event, ReplaceEvent):
        m = event.message
        return {"kind": "replace", "index": event.index, "message": _as_dict(m)}
    if isinstance(event, TruncateEvent):
        return {"kind": "truncate", "length": event.length}
    if isinstance(event, DispatchEvent):
        return {
            "kind": "dispatch",
            "request_id": event.request_id,
            "target": event.target,
            "render": event.render,
            "directives": [list(kv) for kv in event.directives],
            "sha256": event.sha256,
            **({"session_kind": event.session_kind} if event.session_kind else {}),
        }
    return {
        "kind": "response",
        "request_id": event.request_id,
        "usage": [list(kv) for kv in event.usage],
        "response_id": event.response_id,
    }


def encode(event: Event) -> Encoded:
    blobs: dict[str, bytes] = {}
    body = _blob_out(_as_dict(event), blobs)
    return Encoded(canonical_json(body), blobs)


def _blob_in(value: Any, get: Callable[[str], bytes]) -> Any:
    if isinstance(value, dict):
        if set(value) == {"$blob"}:
            return get(value["$blob"]).decode()
        return {k: _blob_in(v, get) for k, v in value.items()}
    if isinstance(value, list):
        return [_blob_in(v, get) for v in value]
    return value


def _pairs(items: list[list[Any]]) -> tuple[tuple[str, Any], ...]:
    return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in items)


def _message(d: dict[str, Any]) -> MessageEvent:
    return MessageEvent(
        d["role"],
        d["content"],
        d.get("name"),
        tool_calls=d.get("tool_calls"),
        tool_call_id=d.get("tool_call_id"),
        thinking=d.get("thinking"),
        tool_changes=d.get("tool_changes"),
        control=d.get("control"),
        parts=d.get("parts"),
    )


def decode(data: bytes, get_blob: Callable[[str], bytes]) -> Event:
    """The event ``encode`` wrote; ``get_blob`` returns a blob's bytes by sha256."""
    d = _blob_in(json.loads(data), get_blob)
    kind = d["kind"]
    if kind == "header":
        header = Header(
            d["model"], d["target"], tuple(d["system"]), d["tools"], _pairs(d["config"])
        )
        return HeaderEvent(header, Reason(d["reason"]))
    if kind == "message":
        return _message(d)
    if kind == "replace":
        return ReplaceEvent(d["index"], _message(d["message"]))
    if kind == "truncate":
        return TruncateEvent(d["length"])
    if kind == "dispatch":
        return DispatchEvent(
            d["request_id"],
            d["target"],
            d["render"],
            _pairs(d["directives"]),
            d["sha256"],
            session_kind=d.get("session_kind"),
        )
    if kind == "response":
        return ResponseEvent(d["request_id"], _pairs(d["usage"]), d["response_id"])
    raise ValueError(f"unknown event kind {kind!r}")


def chain(root: bytes, entries: Sequence[bytes]) -> list[str]:
    """Rolling digests: ``h_0`` of ``root``, ``h_k`` of ``h_{k-1}`` and entry ``k``.

    A request whose entries extend an earlier one's shares its digests up to
    the earlier length, which is how a stateless client's conversation is
    found again (implicit sessions)."""
    out = [hashlib.sha256(root).hexdigest()]
    for e in entries:
        out.append(link(out[-1], e))
    return out


def link(digest: str, entry: bytes) -> str:
    """The rolling digest one entry after ``digest`` (one step of :func:`chain`)."""
    return hashlib.sha256(digest.encode() + b"\0" + entry).hexdigest()


def scoped_session(tenant: str, name: str) -> str:
    """The store's id for a tenant's session name: each tenant has its own namespace, so a
    name another tenant chose is simply another session (tenants never see each other's)."""
    return f"{tenant}/{name}"


def session_name(session_id: str) -> str:
    """The name a client sees (``x-vcache-session``) and sends back for a stored id."""
    return session_id.partition("/")[2] or session_id
