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

Memory: one slot per distinct block in a packed table (:mod:`manifest.packed`:
a 64-bit key and a 64-bit mask of the locations holding it, 16 bytes a slot),
so a block resident on several replicas costs one entry; at most 64 locations.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, NewType

import numpy as np

from manifest.hashing import BlockHash, EventHash, event_hash
from manifest.packed import U64, PackedTable, from_digests, norm

LocationId = NewType("LocationId", str)

AnyHash = BlockHash | EventHash | bytes | int
# one KV event's blocks: (True: stored, False: removed; their hashes)
Change = tuple[bool, Sequence[AnyHash]]


MAX_LOCATIONS = 64
_SENTINEL = 0xFFFF_FFFF_FFFF_FFFF  # how the table stores a key of 0


def _key(h: AnyHash) -> int:
    k = event_hash(h) if isinstance(h, bytes) else int(h)
    return k or _SENTINEL


def _keys(hashes: Iterable[AnyHash]) -> U64:
    """Distinct table keys of ``hashes``."""
    return np.unique(norm(_key(h) for h in hashes))


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

    @property
    def mask(self) -> np.uint64:
        return np.uint64(1 << self.bit)


class PrefixIndex:
    def __init__(self) -> None:
        self._table = PackedTable()  # block key -> bitmask of locations
        self._locations: dict[LocationId, _Location] = {}
        self._events: list[IndexEvent] = []

    # ------------------------------------------------------------ locations

    def add_location(self, location: LocationId) -> None:
        if location not in self._locations:
            used = {loc.bit for loc in self._locations.values()}
            bit = next(i for i in range(len(used) + 1) if i not in used)
            if bit >= MAX_LOCATIONS:
                raise ValueError(f"the prefix index holds at most {MAX_LOCATIONS} locations")
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
        added = self._store(location, _keys(hashes))
        self._events.append(IndexEvent("stored", location, added))
        return added

    def apply_removed(self, location: LocationId, hashes: Iterable[AnyHash]) -> int:
        """Blocks evicted at ``location``; returns how many were resident there."""
        removed, lost = self._remove(location, _keys(hashes))
        self._events.append(IndexEvent("removed", location, removed))
        if lost:
            self._events.append(IndexEvent("pin_lost", location, lost))
        return removed

    def apply_changes(self, location: LocationId, changes: Sequence[Change]) -> tuple[int, int]:
        """Blocks stored and removed at ``location``, in order (one engine step's events):
        the same table, counts, pins and event totals as :meth:`apply_stored` and
        :meth:`apply_removed` one change at a time, with one ``stored`` and one
        ``removed`` event for the lot.  When no block is both stored and removed among
        them (a step's new blocks and the ones it evicted), every store is one
        vectorized insert and every removal one removal; otherwise they are applied one
        by one.  Returns (blocks new there, blocks no longer there)."""
        stored = _keys(h for is_stored, hs in changes if is_stored for h in hs)
        removed = _keys(h for is_stored, hs in changes if not is_stored for h in hs)
        if len(stored) and len(removed) and len(np.intersect1d(stored, removed, True)):
            added = gone = lost = 0
            for is_stored, hs in changes:
                if is_stored:
                    added += self._store(location, _keys(hs))
                else:
                    n, pins = self._remove(location, _keys(hs))
                    gone, lost = gone + n, lost + pins
        else:
            added = self._store(location, stored)
            gone, lost = self._remove(location, removed)
        if any(is_stored for is_stored, _ in changes):
            self._events.append(IndexEvent("stored", location, added))
        if not all(is_stored for is_stored, _ in changes):
            self._events.append(IndexEvent("removed", location, gone))
        if lost:
            self._events.append(IndexEvent("pin_lost", location, lost))
        return added, gone

    def _store(self, location: LocationId, keys: U64) -> int:
        loc = self._loc(location)
        added = len(self._table.add(keys, loc.mask)) if len(keys) else 0
        loc.resident += added
        return added

    def _remove(self, location: LocationId, keys: U64) -> tuple[int, int]:
        """Remove ``keys``: (how many were resident, how many of them lost their pins)."""
        loc = self._loc(location)
        if not len(keys):
            return 0, 0
        removed = self._table.remove(keys, loc.mask)
        lost = sum(1 for k in removed.tolist() if loc.pins.pop(k, 0)) if loc.pins else 0
        loc.resident -= len(removed)
        return len(removed), lost

    def apply_cleared(self, location: LocationId) -> int:
        """The location dropped its whole cache (reset or restart)."""
        loc = self._locations.get(location)
        if loc is None:
            return 0
        dropped = len(self._table.clear_bit(loc.mask))
        lost = len(loc.pins)
        loc.pins.clear()
        loc.resident = 0
        self._events.append(IndexEvent("cleared", location, dropped))
        if lost:
            self._events.append(IndexEvent("pin_lost", location, lost))
        return dropped

    # ----------------------------------------------------------------- pins

    def pin(self, location: LocationId, hashes: Iterable[AnyHash]) -> int:
        """Take one pin on each resident block; returns how many were pinned."""
        loc = self._loc(location)
        keys = norm(_key(h) for h in hashes)
        resident = (self._table.masks(keys) & loc.mask) != 0
        n = 0
        for k in keys[resident].tolist():
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

    def match_digests(self, hashes: Sequence[bytes]) -> dict[LocationId, int]:
        """:meth:`match` for full block hashes (bytes): their keys read in one pass."""
        return self.match_keys(from_digests(hashes))

    def match_keys(self, keys: Sequence[int] | U64) -> dict[LocationId, int]:
        """:meth:`match` for 64-bit event hashes (the hot path: one vectorized lookup).

        The running AND of the locations' masks only ever loses bits; each
        location's prefix ends where its bit is first gone.
        """
        if not len(keys):
            return dict.fromkeys(self._locations, 0)
        running = np.bitwise_and.accumulate(self._table.masks(norm(keys)))
        out: dict[LocationId, int] = {}
        for name, loc in self._locations.items():
            lacks = (running & loc.mask) == 0
            out[name] = int(lacks.argmax()) if lacks[-1] else len(keys)
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
        table = dict(self._table.items())
        for k, m in table.items():
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
                if c <= 0 or not table.get(k, 0) >> loc.bit & 1:
                    raise AssertionError(f"{name}: pin on non-resident block {k:#x}")
            pinned, evictable = len(loc.pins), loc.resident - len(loc.pins)
            if pinned + evictable != loc.resident or evictable < 0:
                raise AssertionError(f"{name}: pinned + evictable != resident")
