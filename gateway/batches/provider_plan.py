"""The provider plan: per hosted target, online requests in DAG order under the rate-limit
headroom against the provider's own batch API, and the cheaper of the two.

Costs are in input-token equivalents at the target's online price (an uncached prompt
token is 1), from the plan's estimates (:mod:`gateway.batches.plan`): ``size`` of each
item's prompt and the ``shared`` tokens its step reads from the item it waits for.  A
prefix is cacheable only from the target's minimum (``min_prefix``) and in its cache
steps; ``r`` is the read multiplier, ``w`` the write multiplier (shared/seeds/001 §5).

- **online, DAG order**: each item after its lead reads the lead's prefix
  (send-one-then-fan); on an explicit provider (Anthropic) each anchor's lead writes it
  once at the 5-minute TTL (its siblings follow at once):
  ``Σ size - Σ cacheable(shared)·(1 - r) + Σ_anchors cacheable·(w5 - 1)``.  Its time
  is bound by the headroom (§5.5): requests per minute ``min(R - R_real, (X - X_real)/P̄)``
  with ``P̄`` the mean prompt; it is feasible when that fits the completion window.
- **the batch API**: the items submitted leads first, billed at ``discount`` (half) of
  the online price, but a batch's caching is best effort: an item reads its anchor with
  probability ``h``: the option's ``hit_share`` (:data:`HIT_SHARE` as the prior, moved
  by what finished provider batches of the target measured,
  :mod:`gateway.batches.hit_share`).  On an explicit provider each anchor gets the
  breakpoint TTL that pays (§5.4): none, 5 minutes or 1 hour, whichever has the lowest
  expected cost per item, ``h·r + (1 - h)·w`` (a miss writes) against 1 without a
  breakpoint; a batch's items run spread over minutes to hours, so the 1-hour TTL's
  hit share is the higher.  On an implicit provider (OpenAI) reads are free to try:
  ``h·cacheable·(1 - r)`` is saved, nothing written.

The choice is the batch API when it is cheaper or when online does not fit the window.
Pure: numbers in, a dict out.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from manifest.prefix_dag import Step, Unit

BATCH_DISCOUNT = 0.5  # OpenAI's Batch API and Anthropic's Message Batches: half price
WINDOW_MIN = 24 * 60.0  # the completion window both offer
# an item's chance of reading its anchor inside a provider's batch (caching is best
# effort there), the prior before any batch of the target was measured: Anthropic
# documents 30% to 98% for batches; the low end for the 5-minute TTL (items spread over
# longer than it), the range's middle for the 1-hour TTL, the middle for an implicit
# provider's automatic caching
HIT_SHARE = {"5m": 0.3, "1h": 0.64, "implicit": 0.64}
PRIOR_WEIGHT = 20.0  # the prior counts as this many measured items
# an answered item of a provider batch: its shared tokens and size as the plan estimated
# them, its prompt (cached included) and cached tokens as billed
Sample = tuple[int, int, int, int]


@dataclass(frozen=True)
class Headroom:
    """What a target's rate limits leave for a batch: requests and input tokens per minute
    (None: not known)."""

    rpm: float | None
    tpm: float | None


@dataclass(frozen=True)
class ProviderOption:
    """A hosted target a batch's model resolves to, with its cache economics."""

    target: str  # provider/model
    explicit: bool  # breakpoints (Anthropic) rather than automatic caching
    read_mult: float
    write_mult: float  # at the short TTL
    long_write_mult: float  # at the long TTL (Anthropic 1h); == write_mult where none
    min_prefix: int
    step: int  # the cache step (OpenAI 128; 1 for breakpoints)
    headroom: Headroom | None = None
    # an item's chance of reading its anchor inside the provider's batch, per kind ("5m",
    # "1h": the breakpoint TTL; "implicit": automatic caching)
    hit_share: Mapping[str, float] = field(default_factory=lambda: dict(HIT_SHARE))


@dataclass(frozen=True)
class Choice:
    """A batch sent to ``target``'s own batch API: the breakpoint TTL its items take
    (``ttl``: "5m", "1h", or None: none or automatic caching) and the hit-share ``kind``
    it measures ("5m", "1h", "implicit")."""

    target: str
    ttl: str | None
    kind: str


def kind_of(o: ProviderOption) -> str:
    """The hit-share kind a batch on ``o``'s batch API runs under (the TTL the plan picks
    on an explicit provider, "implicit" otherwise; "5m" where no breakpoint pays)."""
    if not o.explicit:
        return "implicit"
    return breakpoint_ttl(o)[0] or "5m"


def cacheable(tokens: int, o: ProviderOption) -> int:
    """What of a ``tokens`` prefix the target caches."""
    if tokens < o.min_prefix:
        return 0
    return tokens // o.step * o.step


def _anchors(steps: Sequence[Step]) -> Counter[tuple[str, int]]:
    """Each anchor (lead, shared tokens) with how many items read it."""
    return Counter((st.after, st.shared_tokens) for st in steps if st.after is not None)


def online(
    o: ProviderOption, units: Sequence[Unit], steps: Sequence[Step], window_min: float = WINDOW_MIN
) -> dict[str, Any]:
    """Online requests in DAG order (see the module)."""
    size = sum(u.size for u in units)
    read = sum(cacheable(st.shared_tokens, o) for st in steps)
    written = sum(cacheable(s, o) for _, s in _anchors(steps)) if o.explicit else 0
    cost = size - read * (1 - o.read_mult) + written * (o.write_mult - 1)
    minutes = None
    h = o.headroom
    if h is not None and units and (h.rpm or h.tpm):
        mean = size / len(units)
        per_min = min(
            h.rpm if h.rpm else float("inf"), h.tpm / max(mean, 1.0) if h.tpm else float("inf")
        )
        minutes = len(units) / per_min if per_min > 0 else float("inf")
    return {
        "cost": round(cost, 1),
        "read_tokens": read,
        "write_tokens": written,
        "minutes": round(minutes, 1) if minutes is not None else None,
        "feasible": minutes is None or minutes <= window_min,
    }


def breakpoint_ttl(o: ProviderOption) -> tuple[str | None, float]:
    """The breakpoint TTL with the lowest expected cost per item inside a batch, and that
    cost per cached token (1.0: no breakpoint)."""
    best: tuple[str | None, float] = (None, 1.0)
    for ttl, w in (("5m", o.write_mult), ("1h", o.long_write_mult)):
        h = o.hit_share[ttl]
        per = h * o.read_mult + (1 - h) * w
        if per < best[1]:
            best = (ttl, per)
    return best


def batch_api(
    o: ProviderOption,
    units: Sequence[Unit],
    steps: Sequence[Step],
    discount: float = BATCH_DISCOUNT,
) -> dict[str, Any]:
    """The provider's batch API, the items leads first (see the module)."""
    size = sum(u.size for u in units)
    anchors = _anchors(steps)
    if o.explicit:
        ttl, per = breakpoint_ttl(o)
        if ttl is None:
            read = written = 0
            cost = float(size)
        else:
            h = o.hit_share[ttl]
            w = o.write_mult if ttl == "5m" else o.long_write_mult
            lead = sum(cacheable(s, o) for (_, s) in anchors)
            siblings = sum(cacheable(s, o) * k for (_, s), k in anchors.items())
            read = round(h * siblings)
            written = lead + round((1 - h) * siblings)
            cost = size - siblings + siblings * per + lead * (w - 1)
    else:
        ttl = None
        h = o.hit_share["implicit"]
        read = round(h * sum(cacheable(st.shared_tokens, o) for st in steps))
        written = 0
        cost = size - read * (1 - o.read_mult)
    return {
        "cost": round(discount * cost, 1),
        "discount": discount,
        "read_tokens": read,
        "write_tokens": written,
        "ttl": ttl,
        "hit_share": round(
            o.hit_share[ttl] if ttl else 0.0 if o.explicit else o.hit_share["implicit"], 4
        ),
    }


def compare(
    o: ProviderOption,
    units: Sequence[Unit],
    steps: Sequence[Step],
    discount: float = BATCH_DISCOUNT,
    window_min: float = WINDOW_MIN,
) -> dict[str, Any]:
    """Both ways for one target, and the choice (see the module)."""
    on = online(o, units, steps, window_min)
    off = batch_api(o, units, steps, discount)
    choice = "batch_api" if off["cost"] < on["cost"] or not on["feasible"] else "online"
    return {
        "target": o.target,
        "arrival_order": float(sum(u.size for u in units)),
        "online": on,
        "batch_api": off,
        "choice": choice,
    }


def measure(o: ProviderOption, samples: Iterable[Sample]) -> tuple[float, int]:
    """(hits, reads) of a finished batch on ``o``'s batch API: each item that could read
    an anchor (a shared prefix, cacheable once scaled from the plan's estimate to the
    tokens billed) counts as one read, and as a hit by the share of it that it read (its
    cached tokens over that cacheable prefix, at most 1)."""
    hits, reads = 0.0, 0
    for shared, size, prompt, cached in samples:
        if shared <= 0 or size <= 0 or prompt <= 0:
            continue
        expect = cacheable(round(prompt * min(1.0, shared / size)), o)
        if expect <= 0:
            continue
        reads += 1
        hits += min(1.0, cached / expect)
    return hits, reads


def belief(prior: float, hits: float, reads: float, weight: float = PRIOR_WEIGHT) -> float:
    """The prior hit share moved by ``reads`` measured items of which ``hits`` read, the
    prior counting as ``weight`` items: ``(prior·weight + hits) / (weight + reads)``."""
    return (prior * weight + hits) / (weight + reads)
