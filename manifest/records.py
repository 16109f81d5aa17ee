"""Render records (seed 002): verify, then account.

When a request is accepted, the record keeps, for every cache marker, its
identity (the layout key of the segment it ends on) and the sha256 of every
byte before it as sent.  A provider serves a marker's prefix only while every
one of those bytes is unchanged, so before crediting a later hit,
:func:`verify` re-hashes the current rendering at each marker and keeps only
the markers whose prefix still renders the same.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from manifest.identity import prefix_digests


@dataclass(frozen=True)
class MarkerRecord:
    identity: str
    prefix_bytes: int
    prefix_tokens: int
    prefix_sha256: str


@dataclass(frozen=True)
class RenderRecord:
    request_id: str
    target: str
    markers: tuple[MarkerRecord, ...]


@dataclass(frozen=True)
class MarkerAt:
    """Where a marker sits in a rendering: after ``end_byte`` bytes / ``tokens`` tokens."""

    identity: str
    end_byte: int
    tokens: int


def make_record(
    request_id: str, target: str, rendered: bytes, markers: Sequence[MarkerAt]
) -> RenderRecord:
    for m in markers:
        if not 0 <= m.end_byte <= len(rendered):
            raise ValueError(f"marker {m.identity!r} lies outside the rendering")
    sha = prefix_digests(rendered, (m.end_byte for m in markers))
    return RenderRecord(
        request_id,
        target,
        tuple(MarkerRecord(m.identity, m.end_byte, m.tokens, sha[m.end_byte]) for m in markers),
    )


DropReason = Literal["missing", "changed"]


@dataclass(frozen=True)
class Verified:
    kept: tuple[MarkerRecord, ...]
    dropped: tuple[tuple[MarkerRecord, DropReason], ...]

    @property
    def creditable_tokens(self) -> int:
        """The longest prefix, in tokens, that may still be credited as cached."""
        return max((m.prefix_tokens for m in self.kept), default=0)


def verify(record: RenderRecord, rendered: bytes, markers: Mapping[str, MarkerAt]) -> Verified:
    """Keep each recorded marker whose prefix renders byte-identically now."""

    def same_place(m: MarkerRecord) -> bool:
        now = markers.get(m.identity)
        return now is not None and now.end_byte == m.prefix_bytes <= len(rendered)

    placed = [same_place(m) for m in record.markers]
    ends = (m.prefix_bytes for m, ok in zip(record.markers, placed, strict=True) if ok)
    sha = prefix_digests(rendered, ends)
    kept: list[MarkerRecord] = []
    dropped: list[tuple[MarkerRecord, DropReason]] = []
    for m, ok in zip(record.markers, placed, strict=True):
        if m.identity not in markers:
            dropped.append((m, "missing"))
        elif not ok or sha[m.prefix_bytes] != m.prefix_sha256:
            dropped.append((m, "changed"))
        else:
            kept.append(m)
    return Verified(tuple(kept), tuple(dropped))
