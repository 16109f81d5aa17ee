"""The canonical prompt: ordered segments with kinds and byte-stable serialization.

A provider serves a cached prefix only while every byte before the cut is
unchanged, so the same logical request must always render to the same bytes:
tool schemas and tool-call arguments are serialized with sorted keys and
fixed separators.  :func:`diverge` finds where two renderings part;
:func:`lint` names content that breaks prefix stability; and
:func:`recommend_layout` moves volatile segments after the stable ones.

Segment objects never print their content (prompts do not reach logs): their
``repr`` shows the key, kind, length and digest.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from manifest.identity import ContentDigest, content_digest


class SegmentKind(StrEnum):
    STABLE = "stable"
    TOOL_SCHEMA = "tool_schema"
    VOLATILE = "volatile"
    TOOL_RESULT = "tool_result"
    MESSAGE = "message"


# json.dumps builds an encoder per call when given options; this one is built once (it
# holds no state between calls).
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def canonical_json(value: Any) -> bytes:
    """Sorted keys, no whitespace, UTF-8: one logical value, one byte string."""
    return _CANONICAL.encode(value).encode()


@dataclass(frozen=True)
class Segment:
    key: str  # stable identity in the layout: "tools", "system", "message:3"
    kind: SegmentKind
    data: bytes = field(repr=False)

    @property
    def digest(self) -> ContentDigest:
        return content_digest(self.data)

    def __repr__(self) -> str:
        return (
            f"Segment({self.key!r}, {self.kind.value}, {len(self.data)} bytes, {self.digest[:12]})"
        )


@dataclass(frozen=True)
class CanonicalPrompt:
    segments: tuple[Segment, ...]

    def render(self) -> bytes:
        return b"".join(s.data for s in self.segments)

    def offsets(self) -> list[int]:
        """Byte offset where each segment starts."""
        out, pos = [], 0
        for s in self.segments:
            out.append(pos)
            pos += len(s.data)
        return out

    def keys(self) -> list[str]:
        return [s.key for s in self.segments]


def _canonical_message(message: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message["role"], "content": message.get("content")}
    for name in ("name", "tool_call_id"):
        if message.get(name) is not None:
            out[name] = message[name]
    calls = message.get("tool_calls")
    if calls:
        out["tool_calls"] = [_canonical_call(c) for c in calls]
    return out


def _canonical_call(call: Mapping[str, Any]) -> dict[str, Any]:
    fn = dict(call.get("function", {}))
    args = fn.get("arguments")
    if isinstance(args, str):
        with contextlib.suppress(json.JSONDecodeError):  # not JSON: sent as given
            fn["arguments"] = canonical_json(json.loads(args)).decode()
    elif args is not None:
        fn["arguments"] = canonical_json(args).decode()
    return {**call, "function": fn}


def canonicalize(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    system: str | None = None,
    volatile_system: str | None = None,
) -> CanonicalPrompt:
    """Segments in prefix order: tools → system → (volatile system) → messages.

    ``system`` messages inside ``messages`` are rendered as messages in place;
    a separate ``system`` is the stable system prompt, ``volatile_system`` the
    part the caller knows changes per request (a date, a request id).
    """
    segs: list[Segment] = []
    if tools:
        segs.append(Segment("tools", SegmentKind.TOOL_SCHEMA, canonical_json(list(tools)) + b"\n"))
    if system:
        segs.append(Segment("system", SegmentKind.STABLE, canonical_json(system) + b"\n"))
    if volatile_system:
        segs.append(
            Segment(
                "system:volatile", SegmentKind.VOLATILE, canonical_json(volatile_system) + b"\n"
            )
        )
    for i, m in enumerate(messages):
        kind = SegmentKind.TOOL_RESULT if m.get("role") == "tool" else SegmentKind.MESSAGE
        segs.append(Segment(f"message:{i}", kind, canonical_json(_canonical_message(m)) + b"\n"))
    return CanonicalPrompt(tuple(segs))


@dataclass(frozen=True)
class Divergence:
    segment_index: int
    segment_key: str
    byte_offset: int  # absolute, in the rendered bytes
    offset_in_segment: int


def diverge(previous: CanonicalPrompt, current: CanonicalPrompt) -> Divergence | None:
    """Where ``current`` stops being a byte extension of ``previous``; None if it extends it."""
    pos = 0
    for i, (a, b) in enumerate(zip(previous.segments, current.segments, strict=False)):
        if a.data != b.data:
            n = min(len(a.data), len(b.data))
            j = next((k for k in range(n) if a.data[k] != b.data[k]), n)
            return Divergence(i, b.key, pos + j, j)
        pos += len(a.data)
    if len(previous.segments) > len(current.segments):
        i = len(current.segments)
        return Divergence(i, previous.segments[i].key, pos, 0)
    return None


_PATTERNS: dict[str, re.Pattern[bytes]] = {
    "timestamp": re.compile(
        rb"\b\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?(Z|[+-]\d{2}:?\d{2})?\b"
    ),
    "date": re.compile(rb"\b\d{4}-\d{2}-\d{2}\b"),
    "clock": re.compile(rb"\b\d{1,2}:\d{2}:\d{2}\b"),
    "uuid": re.compile(
        rb"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"
    ),
    "epoch": re.compile(rb"\b1[5-9]\d{8}(\d{3})?\b"),
}


@dataclass(frozen=True)
class Finding:
    """Something that makes a prefix unstable, located without quoting it."""

    rule: str  # timestamp, date, clock, uuid, epoch, reordered_tools
    segment_key: str
    byte_offset: int  # absolute
    length: int


def lint(prompt: CanonicalPrompt, previous: CanonicalPrompt | None = None) -> list[Finding]:
    """Name content in cacheable segments that changes from request to request."""
    out: list[Finding] = []
    offsets = prompt.offsets()
    for seg, start in zip(prompt.segments, offsets, strict=True):
        if seg.kind in (SegmentKind.VOLATILE, SegmentKind.TOOL_RESULT):
            continue  # known to vary, or appended after the cacheable prefix
        claimed: list[tuple[int, int]] = []
        for rule, pat in _PATTERNS.items():
            for m in pat.finditer(seg.data):
                if any(a <= m.start() < b for a, b in claimed):
                    continue  # a date inside a timestamp is one finding
                claimed.append((m.start(), m.end()))
                out.append(Finding(rule, seg.key, start + m.start(), m.end() - m.start()))
    if previous is not None:
        out += _reordered_tools(previous, prompt)
    return sorted(out, key=lambda f: f.byte_offset)


def _tool_names(prompt: CanonicalPrompt) -> list[str]:
    for seg in prompt.segments:
        if seg.kind is SegmentKind.TOOL_SCHEMA:
            tools = json.loads(seg.data)
            return [str(t.get("name") or t.get("function", {}).get("name")) for t in tools]
    return []


def _reordered_tools(previous: CanonicalPrompt, current: CanonicalPrompt) -> list[Finding]:
    before, now = _tool_names(previous), _tool_names(current)
    if sorted(before) == sorted(now) and before != now:
        seg = next(s for s in current.segments if s.kind is SegmentKind.TOOL_SCHEMA)
        return [Finding("reordered_tools", seg.key, 0, len(seg.data))]
    return []


def split_volatile(text: str) -> tuple[str, str]:
    """Split a system prompt into its stable lines and the lines the lint flags.

    Both keep their order; the volatile part is rendered right after the
    stable one, so the stable part stays a byte-stable, cacheable prefix.
    """
    stable: list[str] = []
    volatile: list[str] = []
    for line in text.splitlines(keepends=True):
        data = line.encode()
        (volatile if any(p.search(data) for p in _PATTERNS.values()) else stable).append(line)
    return "".join(stable), "".join(volatile)


def recommend_layout(prompt: CanonicalPrompt, findings: Sequence[Finding] = ()) -> CanonicalPrompt:
    """Move volatile segments — and stable ones the lint flagged — after all others.

    Message order is never changed; only tools/system-level segments move, and
    the relative order of moved segments is kept.
    """
    flagged = {f.segment_key for f in findings if f.rule != "reordered_tools"}
    kept: list[Segment] = []
    moved: list[Segment] = []
    for seg in prompt.segments:
        movable = seg.kind in (SegmentKind.VOLATILE, SegmentKind.STABLE)
        if movable and (seg.kind is SegmentKind.VOLATILE or seg.key in flagged):
            moved.append(Segment(seg.key, SegmentKind.VOLATILE, seg.data))
        else:
            kept.append(seg)
    return CanonicalPrompt(tuple(kept + moved))
