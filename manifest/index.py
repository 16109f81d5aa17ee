"""The prefix index: which location holds which blocks.

A location is an engine replica (or a provider key/shard).  The index folds
KV events — block stored, block removed, all cleared — per location and
answers, for a prompt's block hashes, each location's longest *consecutive*
resident prefix: exactly what that location's prefix cache can serve.

Contract:

- Hashes are keyed by their 64-bit event form (:func:`manifest.hashing.event_hash`),
  the form vLLM's KV events carry; full hashes are narrowed on the way in.
- Every mutation appends an :class:`IndexEvent`; the owner drains them with
  :meth:`PrefixIndex.take_events`.  The index never publishes anything itself.
- Pins are reference counts per (location, block) and only on resident blocks.
  A removal of a pinned block drops its pins and records ``pin_lost``.
- :meth:`check_integrity` proves ``pinned + evictable == resident`` per
  location and that the shared table and per-location counts agree.

Memory: one dict entry per distinct block; its value is a bitmask of the
locations holding it, so a block resident on several replicas costs one entry.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, repeat
from operator import and_
from typing import Literal, NamedTuple, NewType

from manifest.hashing import BlockHash, EventHash, event_hash

LocationId = NewType("LocationId", str)

AnyHash = BlockHash | EventHash | bytes | int


def _key(h: AnyHash) -> int:
    return event_hash(h) if isinstance(h, bytes) else int(h)


def _lacks(bit: int) -> Callable[[int], bool]:
    def lacks(mask: int) -> bool:
        return not mask & bit

    return lacks


class IndexEvent(NamedTuple):
    kind: Literal["stored", "removed", "cleared", "pinned", "unpinned", "pin_lost"]
    location: LocationId
    blocks: int


class LocationCounts(NamedTuple):
    resident: int
    pinned: int
    evictable: int


@dataclass
class _Location:
    bit: int
    resident: int = 0
    pins: dict[int, int] = field(default_factory=dict)


class PrefixIndex:
    def __init__(self) -> None:
        self._table: dict[int, int] = {}  # block key -> bitmask of locations
        self._locations: dict[LocationId, _Location] = {}
        self._events: list[IndexEvent] = []

    # ------------------------------------------------------------ locations

    def add_location(self, location: LocationId) -> None:
        if location not in self._locations:
            used = {loc.bit for loc in self._locations.values()}
            bit = next(i for i in range(len(used) + 1) if i not in used)
            self._locations[location] = _Location(bit=bit)

    def remove_location(self, location: LocationId) -> None:
        """Forget a location entirely (replica gone)."""
        self.apply_cleared(location)
        self._locations.pop(location, None)

    @property
    def locations(self) -> list[LocationId]:
        return list(self._locations)

    def _loc(self, location: LocationId) -> _Location:
        self.add_location(location)
        return self._locations[location]

    # ------------------------------------------------------------ KV events

    def apply_stored(self, location: LocationId, hashes: Iterable[AnyHash]) -> int:
        """Blocks now resident at ``location``; returns how many were new there."""
        loc = self._loc(location)
        mask = 1 << loc.bit
        added = 0
        for h in hashes:
            k = _key(h)
            cur = self._table.get(k, 0)
            if not cur & mask:
                self._table[k] = cur | mask
                added += 1
        loc.resident += added
        self._events.append(IndexEvent("stored", location, added))
        return added

    def apply_removed(self, location: LocationId, hashes: Iterable[AnyHash]) -> int:
        """Blocks evicted at ``location``; returns how many were resident there."""
        loc = self._loc(location)
        mask = 1 << loc.bit
        removed = lost = 0
        for h in hashes:
            k = _key(h)
            cur = self._table.get(k, 0)
            if cur & mask:
                rest = cur & ~mask
                if rest:
                    self._table[k] = rest
                else:
                    del self._table[k]
                removed += 1
                if loc.pins.pop(k, 0):
                    lost += 1
        loc.resident -= removed
        self._events.append(IndexEvent("removed", location, removed))
        if lost:
            self._events.append(IndexEvent("pin_lost", location, lost))
        return removed

    def apply_cleared(self, location: LocationId) -> int:
        """The location dropped its whole cache (reset or restart)."""
        loc = self._locations.get(location)
        if loc is None:
            return 0
        mask = 1 << loc.bit
        dropped = [k for k, m in self._table.items() if m & mask]
        for k in dropped:
            rest = self._table[k] & ~mask
            if rest:
                self._table[k] = rest
            else:
                del self._table[k]
        lost = len(loc.pins)
        loc.pins.clear()
        loc.resident = 0
        self._events.append(IndexEvent("cleared", location, len(dropped)))
        if lost:
            self._events.append(IndexEvent("pin_lost", location, lost))
        return len(dropped)

    # ----------------------------------------------------------------- pins

    def pin(self, location: LocationId, hashes: Iterable[AnyHash]) -> int:
        """Take one pin on each resident block; returns how many were pinned."""
        loc = self._loc(location)
        mask = 1 << loc.bit
        n = 0
        for h in hashes:
            k = _key(h)
            if self._table.get(k, 0) & mask:
                loc.pins[k] = loc.pins.get(k, 0) + 1
                n += 1
        self._events.append(IndexEvent("pinned", location, n))
        return n

    def unpin(self, location: LocationId, hashes: Iterable[AnyHash]) -> int:
        """Release one pin on each block; returns how many pins were released."""
        loc = self._loc(location)
        n = 0
        for h in hashes:
            k = _key(h)
            c = loc.pins.get(k, 0)
            if c == 1:
                del loc.pins[k]
            elif c > 1:
                loc.pins[k] = c - 1
            n += c > 0
        self._events.append(IndexEvent("unpinned", location, n))
        return n

    def is_pinned(self, location: LocationId, h: AnyHash) -> bool:
        loc = self._locations.get(location)
        return loc is not None and _key(h) in loc.pins

    # -------------------------------------------------------------- queries

    def match(self, hashes: Sequence[AnyHash]) -> dict[LocationId, int]:
        """Each location's longest consecutive resident prefix, in blocks."""
        return self.match_keys([h if isinstance(h, int) else event_hash(h) for h in hashes])

    def match_keys(self, keys: Sequence[int]) -> dict[LocationId, int]:
        """:meth:`match` for 64-bit event hashes (the hot path: no conversion).

        The running AND of the locations' masks only ever loses bits, so each
        location's prefix length is a binary search over it.
        """
        running = list(accumulate(map(self._table.get, keys, repeat(0)), and_))
        out: dict[LocationId, int] = {}
        for name, loc in self._locations.items():
            out[name] = bisect_left(running, True, key=_lacks(1 << loc.bit))
        return out

    def counts(self, location: LocationId) -> LocationCounts:
        loc = self._locations.get(location)
        if loc is None:
            return LocationCounts(0, 0, 0)
        pinned = len(loc.pins)
        return LocationCounts(loc.resident, pinned, loc.resident - pinned)

    def __len__(self) -> int:
        """Distinct blocks resident anywhere."""
        return len(self._table)

    def take_events(self) -> list[IndexEvent]:
        events, self._events = self._events, []
        return events

    def check_integrity(self) -> None:
        """Raise AssertionError unless every conservation law holds."""
        per_bit = {loc.bit: 0 for loc in self._locations.values()}
        for k, m in self._table.items():
            if m == 0:
                raise AssertionError(f"empty mask kept for block {k:#x}")
            for b in per_bit:
                per_bit[b] += (m >> b) & 1
            if m >> (max(per_bit, default=-1) + 1):
                raise AssertionError(f"block {k:#x} held by an unknown location")
        for name, loc in self._locations.items():
            if per_bit[loc.bit] != loc.resident:
                raise AssertionError(f"{name}: resident {loc.resident} != {per_bit[loc.bit]}")
            for k, c in loc.pins.items():
                if c <= 0 or not self._table.get(k, 0) >> loc.bit & 1:
                    raise AssertionError(f"{name}: pin on non-resident block {k:#x}")
            pinned, evictable = len(loc.pins), loc.resident - len(loc.pins)
            if pinned + evictable != loc.resident or evictable < 0:
                raise AssertionError(f"{name}: pinned + evictable != resident")
