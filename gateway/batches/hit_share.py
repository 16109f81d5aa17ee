"""The in-batch hit share the provider plan assumes, calibrated from measurement.

A provider's caching inside its batch API is best effort: an item after its anchor's
lead reads the anchor with some probability ``h``.  The plan starts from the stated
prior (:data:`~gateway.batches.provider_plan.HIT_SHARE`) and moves with what finished
provider batches of the same target measured, per kind (the breakpoint TTL the items
took, or "implicit" caching), as a belief does: the prior counts as ``weight`` items,
each measured item as one,

    h = (prior · weight + hits) / (weight + reads)

:func:`~gateway.batches.provider_plan.measure` reads a finished batch: each item
that could read an anchor (its step has a lead and a cacheable shared prefix) counts as
one read, and as a hit by the share of that prefix it read (its cached tokens over the
cacheable prefix, scaled from the plan's estimate to the tokens billed, at most 1).  The
sums are kept in the batch store (:meth:`BatchStore.add_hit_share`), so a restart and
every gateway over one PostgreSQL store plan with them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from gateway.batches.provider_plan import HIT_SHARE, PRIOR_WEIGHT, belief


class Kept(Protocol):
    """Where the measures are kept (:class:`~gateway.batches.store.BatchStore`)."""

    def add_hit_share(self, target: str, kind: str, hits: float, reads: float) -> None: ...

    def hit_shares(self) -> dict[tuple[str, str], tuple[float, float]]: ...


class HitShares:
    def __init__(
        self,
        kept: Kept,
        prior: Mapping[str, float] = HIT_SHARE,
        weight: float = PRIOR_WEIGHT,
    ) -> None:
        self._kept = kept
        self._prior = dict(prior)
        self._weight = weight

    def of(self, target: str) -> dict[str, float]:
        """``target``'s hit share per kind, as measured so far (the prior where nothing was)."""
        seen = self._kept.hit_shares()
        out = {}
        for kind, prior in self._prior.items():
            hits, reads = seen.get((target, kind), (0.0, 0.0))
            out[kind] = belief(prior, hits, reads, self._weight)
        return out

    def learn(self, target: str, kind: str, hits: float, reads: float) -> None:
        """Add a finished batch's measure (nothing when it had no item that could read)."""
        if reads > 0:
            self._kept.add_hit_share(target, kind, hits, reads)
