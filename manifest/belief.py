"""Warmth belief: on providers we cannot ask "is X warm?", only learn it after a call.

For each (target, prefix digest) the belief keeps when it was last warmed, a
TTL estimate and the bytes of the prefix as sent.  The probability that it is
still resident decays with age: a documented TTL (``exact_ttl``) is a step,
an undocumented one an exponential survival with that mean.  After every real
call :meth:`WarmthBelief.fold` reads the usage telemetry: a read refreshes
the entry; a believed-warm entry that reads cold is marked *broken* with the
first byte where what was sent differs from what was warmed — never credited.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from manifest.identity import ContentDigest


@dataclass(frozen=True)
class WarmthEntry:
    target: str
    prefix: ContentDigest
    prefix_tokens: int
    last_warmed: float  # seconds, caller's clock
    ttl_s: float
    exact_ttl: bool
    sent: bytes = field(repr=False)  # the prefix bytes as they were warmed
    observed_cached: int = 0
    broken_at: int | None = None  # first diverging byte offset, once cold was read

    def probability(self, now: float) -> float:
        if self.broken_at is not None:
            return 0.0
        age = max(0.0, now - self.last_warmed)
        if self.exact_ttl:
            return 1.0 if age < self.ttl_s else 0.0
        return math.exp(-age / self.ttl_s)


@dataclass(frozen=True)
class Telemetry:
    """What one call reported, with the prefix bytes it actually sent."""

    target: str
    prefix: ContentDigest
    prefix_tokens: int
    cached_tokens: int
    sent: bytes = field(repr=False)
    now: float = 0.0


@dataclass(frozen=True)
class FoldResult:
    believed_warm: bool
    confirmed: bool  # the provider reported reading at least this prefix
    broken_at: int | None  # believed warm, read cold: where the bytes differ (None: they match)
    false_warm: bool


def first_difference(a: bytes, b: bytes) -> int | None:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return None if len(a) == len(b) else n


class WarmthBelief:
    def __init__(self, warm_threshold: float = 0.5) -> None:
        self._entries: dict[tuple[str, ContentDigest], WarmthEntry] = {}
        self._threshold = warm_threshold
        self.false_warm_count = 0

    def record_warm(
        self,
        target: str,
        prefix: ContentDigest,
        prefix_tokens: int,
        sent: bytes,
        now: float,
        ttl_s: float,
        exact_ttl: bool,
    ) -> WarmthEntry:
        entry = WarmthEntry(target, prefix, prefix_tokens, now, ttl_s, exact_ttl, sent)
        self._entries[(target, prefix)] = entry
        return entry

    def get(self, target: str, prefix: ContentDigest) -> WarmthEntry | None:
        return self._entries.get((target, prefix))

    def probability(self, target: str, prefix: ContentDigest, now: float) -> float:
        entry = self.get(target, prefix)
        return 0.0 if entry is None else entry.probability(now)

    def fold(self, t: Telemetry) -> FoldResult:
        entry = self.get(t.target, t.prefix)
        believed = entry is not None and entry.probability(t.now) >= self._threshold
        confirmed = t.cached_tokens >= t.prefix_tokens > 0
        if entry is not None and believed and not confirmed:
            offset = first_difference(entry.sent, t.sent)
            self._entries[(t.target, t.prefix)] = replace(
                entry, broken_at=offset if offset is not None else len(t.sent)
            )
            self.false_warm_count += 1
            return FoldResult(True, False, offset, True)
        if confirmed:
            base = entry or WarmthEntry(
                t.target, t.prefix, t.prefix_tokens, t.now, 300.0, False, t.sent
            )
            self._entries[(t.target, t.prefix)] = replace(
                base, last_warmed=t.now, observed_cached=t.cached_tokens, broken_at=None
            )
        return FoldResult(believed, confirmed, None, False)

    def expire(self, now: float, floor: float = 0.01) -> int:
        """Drop entries whose probability fell under ``floor``; returns how many."""
        dead = [k for k, e in self._entries.items() if e.probability(now) < floor]
        for k in dead:
            del self._entries[k]
        return len(dead)

    def __len__(self) -> int:
        return len(self._entries)
