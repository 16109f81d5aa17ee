"""Who holds which pinned KV block, and until when: a pure book (times passed in).

A block pinned in the engine is held by one or more owners' leases; one owner
holds at most one lease on a block (renewing replaces it).  A block nobody
holds any more is to be unpinned in the engine: the book says which, the
caller does it (decide, then hand over).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from manifest.hashing import BlockHash
from manifest.index import LocationId

Key = tuple[LocationId, BlockHash]


@dataclass(frozen=True)
class Lease:
    owner: str
    expires_at: float


class LeaseBook:
    def __init__(self) -> None:
        self._held: dict[Key, list[Lease]] = {}
        self._per_replica: Counter[LocationId] = Counter()

    def __len__(self) -> int:
        return len(self._held)

    def count(self, replica: LocationId) -> int:
        """Blocks pinned on ``replica`` (for this book's owners)."""
        return self._per_replica[replica]

    def _forget(self, key: Key) -> None:
        del self._held[key]
        self._per_replica[key[0]] -= 1

    def pinned(self, replica: LocationId, h: BlockHash) -> bool:
        """Whether the engine holds ``h`` pinned for someone (a lease, or one pending)."""
        return (replica, h) in self._held

    def owners(self, replica: LocationId, h: BlockHash) -> list[str]:
        return [x.owner for x in self._held.get((replica, h), [])]

    def add(self, replica: LocationId, hashes: Iterable[BlockHash]) -> None:
        """Blocks the engine has just pinned (their leases follow with :meth:`grant`)."""
        for h in hashes:
            if (replica, h) not in self._held:
                self._held[(replica, h)] = []
                self._per_replica[replica] += 1

    def grant(self, replica: LocationId, h: BlockHash, lease: Lease) -> bool:
        """``lease`` on a pinned block (replacing its owner's earlier one); False when the
        block is not pinned."""
        leases = self._held.get((replica, h))
        if leases is None:
            return False
        leases[:] = [x for x in leases if x.owner != lease.owner] + [lease]
        return True

    def release(
        self, replica: LocationId, hashes: Iterable[BlockHash], owner: str | None
    ) -> list[BlockHash]:
        """Drop ``owner``'s leases (every owner's when None); the blocks nobody holds now,
        to unpin."""
        free = []
        for h in hashes:
            leases = self._held.get((replica, h))
            if leases is None:
                continue
            leases[:] = [x for x in leases if owner is not None and x.owner != owner]
            if not leases:
                self._forget((replica, h))
                free.append(h)
        return free

    def replicas(self) -> list[LocationId]:
        """The replicas where this book's owners hold blocks."""
        return [r for r, n in self._per_replica.items() if n]

    def expire(
        self, now: float, replica: LocationId | None = None
    ) -> dict[LocationId, list[BlockHash]]:
        """Drop every lease (on ``replica``; None: everywhere) that has ended by ``now``;
        per replica, the blocks nobody holds any more, to unpin."""
        free: dict[LocationId, list[BlockHash]] = {}
        for (r, h), leases in list(self._held.items()):
            if replica is not None and r != replica:
                continue
            leases[:] = [x for x in leases if x.expires_at > now]
            if not leases:
                self._forget((r, h))
                free.setdefault(r, []).append(h)
        return free

    def drop(self, replica: LocationId) -> int:
        """Forget a replica's pins (its cache was cleared); how many blocks were held."""
        lost = [k for k in self._held if k[0] == replica]
        for k in lost:
            self._forget(k)
        return len(lost)

    def check_integrity(self) -> None:
        """One lease per owner and block; the per-replica counts are the book's."""
        per = Counter(replica for replica, _ in self._held)
        if +per != +self._per_replica:
            raise AssertionError(f"pinned per replica {dict(per)} != {dict(self._per_replica)}")
        for key, leases in self._held.items():
            owners = [x.owner for x in leases]
            if len(owners) != len(set(owners)):
                raise AssertionError(f"{key}: an owner holds two leases")
