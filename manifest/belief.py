"""Warmth belief: on providers we cannot ask "is X warm?", only learn it after a call.

For each (target, prefix digest) the belief keeps when it was last warmed, a
TTL estimate and the bytes of the prefix as sent.  The probability that it is
still resident decays with age: a documented TTL (``exact_ttl``) is a step,
an undocumented one an exponential survival with that mean.  After every real
call :meth:`WarmthBelief.fold` reads the usage telemetry: a read refreshes
the entry; a believed-warm entry that reads cold is marked *broken* with the
first byte where what was sent differs from what was warmed — never credited.

Memory is bounded: at most ``max_entries`` entries, the least recently warmed
dropped first (recorded; the owner drains them with :meth:`take_evicted`).
The prefix bytes may be a ``memoryview`` into the whole prompt, so the
boundaries of one request share one buffer instead of a copy each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from manifest.identity import ContentDigest

Buffer = bytes | memoryview
Key = tuple[str, ContentDigest]


@dataclass(frozen=True)
class WarmthEntry:
    target: str
    prefix: ContentDigest
    prefix_tokens: int
    last_warmed: float  # seconds, caller's clock
    ttl_s: float
    exact_ttl: bool
    sent: Buffer = field(repr=False)  # the prefix bytes as they were warmed
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
    sent: Buffer = field(repr=False)
    now: float = 0.0


@dataclass(frozen=True)
class FoldResult:
    believed_warm: bool
    confirmed: bool  # the provider reported reading at least this prefix
    broken_at: int | None  # believed warm, read cold: where the bytes differ (None: they match)
    false_warm: bool


def first_difference(a: Buffer, b: Buffer) -> int | None:
    """The first offset where ``a`` and ``b`` differ (None when equal).

    Bisection over slice comparisons: each comparison is a C ``memcmp``, so a
    400 KB prefix costs about 20 of them instead of a Python loop per byte.
    """
    a, b = memoryview(a), memoryview(b)
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return None if len(a) == len(b) else n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[lo:hi] != b[lo:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class WarmthBelief:
    def __init__(self, warm_threshold: float = 0.5, max_entries: int = 65536) -> None:
        self._entries: dict[Key, WarmthEntry] = {}  # least recently warmed first
        self._threshold = warm_threshold
        self.max_entries = max_entries
        self._evicted: list[Key] = []
        self.false_warm_count = 0

    def _put(self, key: Key, entry: WarmthEntry) -> None:
        self._entries.pop(key, None)
        self._entries[key] = entry
        while len(self._entries) > self.max_entries:
            oldest = next(iter(self._entries))
            del self._entries[oldest]
            self._evicted.append(oldest)

    def take_evicted(self) -> list[Key]:
        """The keys dropped for room since the last call (the owner forgets them too)."""
        out, self._evicted = self._evicted, []
        return out

    def record_warm(
        self,
        target: str,
        prefix: ContentDigest,
        prefix_tokens: int,
        sent: Buffer,
        now: float,
        ttl_s: float,
        exact_ttl: bool,
    ) -> WarmthEntry:
        entry = WarmthEntry(target, prefix, prefix_tokens, now, ttl_s, exact_ttl, sent)
        self._put((target, prefix), entry)
        return entry

    def entries(self) -> list[WarmthEntry]:
        """Every entry, least recently warmed first."""
        return list(self._entries.values())

    def forget(self, target: str, prefix: ContentDigest) -> bool:
        """Drop an entry (another gateway read it cold); whether there was one."""
        return self._entries.pop((target, prefix), None) is not None

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
            # an entry learnt from another gateway carries no bytes; its digest matched,
            # so its bytes did: the provider evicted it
            offset = first_difference(entry.sent, t.sent) if len(entry.sent) else None
            self._entries[(t.target, t.prefix)] = replace(
                entry, broken_at=offset if offset is not None else len(t.sent)
            )
            self.false_warm_count += 1
            return FoldResult(True, False, offset, True)
        if confirmed:
            base = entry or WarmthEntry(
                t.target, t.prefix, t.prefix_tokens, t.now, 300.0, False, t.sent
            )
            self._put(
                (t.target, t.prefix),
                replace(base, last_warmed=t.now, observed_cached=t.cached_tokens, broken_at=None),
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
