"""A packed hash table from 64-bit block keys to 64-bit location masks.

The prefix index holds one entry per resident block: millions on a large
deployment.  A Python dict costs about 42 bytes per entry before its key, and
a 64-bit int key is 36 more; this table keeps keys and masks in two
``uint64`` arrays (16 bytes a slot) at a load of 45-90 %: under 36 bytes an
entry, and lookups of a whole prompt's blocks run vectorized.

Layout: bucketized cuckoo hashing, 4 slots a bucket, two candidate buckets per
key (two multiplicative hashes), so a lookup is exactly two gathers.  An
insert takes a free slot in either bucket; when both are full it evicts a
resident to its other bucket (a bounded chain of kicks), and when that fails
the table doubles.  Batches are placed vectorized first; only collisions take
the scalar path.  Key 0 marks an empty slot: a real key 0 is stored as
``2**64 - 1`` (:func:`norm`).

A few keys at a time (one engine step's KV events, a short prompt's match:
up to ``SMALL``) take a scalar path instead: numpy's fixed cost, ~20 µs a
vectorized lookup however few the keys, is more than a Python loop's ~1 µs a key.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import numpy.typing as npt

U64 = npt.NDArray[np.uint64]
SLOTS = 4
_SENTINEL = np.uint64(0xFFFF_FFFF_FFFF_FFFF)
_H1 = np.uint64(0x9E37_79B9_7F4A_7C15)
_H2 = np.uint64(0xC2B2_AE3D_27D4_EB4F)
_MAX_KICKS = 64
_MAX_LOAD = 0.9
SMALL = 16  # at most this many keys: the scalar path
_M64 = (1 << 64) - 1


def _position(hits: npt.NDArray[np.uint32]) -> npt.NDArray[np.intp]:
    """The byte (0-3) set in each little-endian word of four 0/1 bytes."""
    return (hits > 0xFF).astype(np.intp) + (hits > 0xFFFF).astype(np.intp) + (hits > 0xFFFFFF)


def norm(keys: Iterable[int] | U64) -> U64:
    """Keys as a ``uint64`` array, 0 mapped to the sentinel (0 marks an empty slot)."""
    if isinstance(keys, np.ndarray):
        arr = keys.astype(np.uint64, copy=True)
    else:
        arr = np.fromiter(keys, dtype=np.uint64)
    if not arr.all():
        arr[arr == 0] = _SENTINEL
    return arr


def from_digests(digests: Sequence[bytes]) -> U64:
    """The keys of block hashes: their low 64 bits, big-endian (``event_hash``), read
    straight from the bytes."""
    if not digests:
        return np.zeros(0, dtype=np.uint64)
    rows = np.frombuffer(b"".join(digests), dtype=np.uint8).reshape(len(digests), -1)
    return norm(np.ascontiguousarray(rows[:, -8:]).view(">u8").ravel())


class PackedTable:
    def __init__(self, buckets_log2: int = 8) -> None:
        self._alloc(buckets_log2)
        self._n = 0

    def _alloc(self, bits: int) -> None:
        self._bits = bits
        self._keys = np.zeros((1 << bits) * SLOTS, dtype=np.uint64)
        self._masks = np.zeros((1 << bits) * SLOTS, dtype=np.uint64)

    def __len__(self) -> int:
        return self._n

    @property
    def capacity(self) -> int:
        return len(self._keys)

    def _buckets(self, keys: U64) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.intp]]:
        shift = np.uint64(64 - self._bits)
        with np.errstate(over="ignore"):
            b1 = (keys * _H1) >> shift
            b2 = (keys * _H2) >> shift
        return b1.astype(np.intp), b2.astype(np.intp)

    def slots(self, keys: U64) -> npt.NDArray[np.intp]:
        """Each key's slot, -1 where it is absent (two gathers of four slots).

        A bucket holds a key at most once, so its four compare results, read as one
        little-endian ``uint32``, are 0 or one set byte whose position is the slot."""
        b1, b2 = self._buckets(keys)
        table = self._keys.reshape(-1, SLOTS)
        col = keys[:, None]
        hit1 = (np.take(table, b1, axis=0) == col).view("<u4").ravel()
        hit2 = (np.take(table, b2, axis=0) == col).view("<u4").ravel()
        first = hit1 != 0
        bucket = np.where(first, b1, b2)
        hit = np.where(first, hit1, hit2)
        return np.where(hit != 0, bucket * SLOTS + _position(hit), -1)

    def _pair(self, key: int) -> tuple[int, int]:
        """``key``'s two buckets, as :meth:`_buckets` computes them."""
        shift = 64 - self._bits
        return ((key * int(_H1)) & _M64) >> shift, ((key * int(_H2)) & _M64) >> shift

    def _slot(self, key: int) -> int:
        """:meth:`slots` for one key."""
        for b in self._pair(key):
            row: list[int] = self._keys[b * SLOTS : (b + 1) * SLOTS].tolist()
            if key in row:
                return b * SLOTS + row.index(key)
        return -1

    def masks(self, keys: U64) -> U64:
        """Each key's mask, 0 where it is absent."""
        if len(keys) <= SMALL:
            m = self._masks
            few = [int(m[s]) if s >= 0 else 0 for s in map(self._slot, keys.tolist())]
            return np.array(few, dtype=np.uint64)
        s = self.slots(keys)
        found: U64 = np.take(self._masks, s)  # -1 reads the last slot: masked below
        return np.where(s >= 0, found, np.uint64(0))

    # -------------------------------------------------------------- writes

    def add(self, keys: U64, bit: np.uint64) -> U64:
        """Set ``bit`` on each (distinct) key, inserting absent ones; returns the keys
        whose bit was not set before."""
        if len(keys) <= SMALL:
            return self._add_few(keys.tolist(), int(bit))
        s = self.slots(keys)
        here = s >= 0
        had = np.zeros(len(keys), dtype=bool)
        had[here] = (self._masks[s[here]] & bit) != 0
        self._masks[s[here]] |= bit
        fresh = keys[~here]
        if len(fresh):
            self._place(fresh, np.full(len(fresh), bit, dtype=np.uint64))
        newly: U64 = keys[~had]
        return newly

    def remove(self, keys: U64, bit: np.uint64) -> U64:
        """Clear ``bit`` on each (distinct) key; a key left with no bit is dropped.
        Returns the keys that had the bit."""
        if len(keys) <= SMALL:
            return self._remove_few(keys.tolist(), int(bit))
        s = self.slots(keys)
        here = s >= 0
        s_here = s[here]
        hit = (self._masks[s_here] & bit) != 0
        slots = s_here[hit]
        self._masks[slots] &= ~bit
        emptied = slots[self._masks[slots] == 0]
        self._keys[emptied] = 0
        self._n -= len(emptied)
        removed: U64 = keys[here][hit]
        return removed

    def _add_few(self, keys: list[int], bit: int) -> U64:
        """:meth:`add`, one key at a time."""
        newly = []
        for k in keys:
            s = self._slot(k)
            if s < 0:
                if self._n + 1 > _MAX_LOAD * self.capacity:
                    self._grow(self._n + 1)
                self._cuckoo(k, bit)
            elif not int(self._masks[s]) & bit:
                self._masks[s] = int(self._masks[s]) | bit
            else:
                continue
            newly.append(k)
        return np.array(newly, dtype=np.uint64)

    def _remove_few(self, keys: list[int], bit: int) -> U64:
        """:meth:`remove`, one key at a time."""
        removed = []
        for k in keys:
            s = self._slot(k)
            m = int(self._masks[s]) if s >= 0 else 0
            if m & bit:
                self._masks[s] = m ^ bit
                if m == bit:
                    self._keys[s] = 0
                    self._n -= 1
                removed.append(k)
        return np.array(removed, dtype=np.uint64)

    def clear_bit(self, bit: np.uint64) -> U64:
        """Clear ``bit`` everywhere; returns the keys that had it."""
        hit = np.flatnonzero(self._masks & bit)
        had = self._keys[hit].copy()
        self._masks[hit] &= ~bit
        emptied = hit[self._masks[hit] == 0]
        self._keys[emptied] = 0
        self._n -= len(emptied)
        return had

    def count_bit(self, bit: np.uint64) -> int:
        return int(np.count_nonzero(self._masks & bit))

    def items(self) -> Iterator[tuple[int, int]]:
        live = np.flatnonzero(self._masks)
        yield from zip(self._keys[live].tolist(), self._masks[live].tolist(), strict=True)

    # ------------------------------------------------------------ placement

    def _place(self, keys: U64, masks: U64) -> None:
        """Insert absent keys: free slots first, vectorized; collisions one by one."""
        if (self._n + len(keys)) > _MAX_LOAD * self.capacity:
            self._grow(self._n + len(keys))
        for _ in range(3):
            if not len(keys):
                return
            keys, masks = self._place_free(keys, masks)
        for k, m in zip(keys.tolist(), masks.tolist(), strict=True):
            self._cuckoo(k, m)

    def _place_free(self, keys: U64, masks: U64) -> tuple[U64, U64]:
        """One round: each key takes the first free slot of its first bucket with one,
        one key per slot; returns the keys that found none."""
        table = self._keys.reshape(-1, SLOTS)
        b1, b2 = self._buckets(keys)
        free1, free2 = table[b1] == 0, table[b2] == 0
        has1, has2 = free1.any(axis=1), free2.any(axis=1)
        slot = np.full(len(keys), -1, dtype=np.intp)
        slot[has1] = b1[has1] * SLOTS + free1[has1].argmax(axis=1)
        use2 = has2 & ~has1
        slot[use2] = b2[use2] * SLOTS + free2[use2].argmax(axis=1)
        want = np.flatnonzero(slot >= 0)
        _, first = np.unique(slot[want], return_index=True)
        won = want[first]
        self._keys[slot[won]] = keys[won]
        self._masks[slot[won]] = masks[won]
        self._n += len(won)
        left = np.ones(len(keys), dtype=bool)
        left[won] = False
        return keys[left], masks[left]

    def _cuckoo(self, key: int, mask: int) -> None:
        """One absent key: a free slot of its first bucket with one, else by kicks."""
        k, m = key, mask
        for kick in range(_MAX_KICKS):
            b1, b2 = self._pair(k)
            for b in (b1, b2):
                row: list[int] = self._keys[b * SLOTS : (b + 1) * SLOTS].tolist()
                if 0 in row:
                    i = b * SLOTS + row.index(0)
                    self._keys[i], self._masks[i] = k, m
                    self._n += 1
                    return
            b = b1 if kick % 2 == 0 else b2
            i = b * SLOTS + (kick * 3 + 1) % SLOTS
            (k, self._keys[i]), (m, self._masks[i]) = (
                (int(self._keys[i]), k),
                (int(self._masks[i]), m),
            )
        self._grow(self._n + 1)
        self._cuckoo(k, m)

    def _grow(self, need: int) -> None:
        live = np.flatnonzero(self._masks)
        keys, masks = self._keys[live].copy(), self._masks[live].copy()
        bits = self._bits + 1
        while (1 << bits) * SLOTS * _MAX_LOAD < need:
            bits += 1
        self._alloc(bits)
        self._n = 0
        if len(keys):
            self._place(keys, masks)
