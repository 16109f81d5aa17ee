"""Calibration (milestone M1): a provider's cache rules fitted from its usage telemetry.

Providers change their rules (per-model minimums, TTLs, cache steps) without
notice, and some never publish them.  The calibrator (``gateway`` side: the
sends and the clock) probes a target and this module fits what it saw:

- the **minimum** cacheable prefix: a :class:`Search` over the probe's size
  finds the smallest prompt that caches; the tokens it reports cached (or
  written) there are the minimum;
- the **granularity**: the greatest common divisor of the cached counts above
  the minimum (OpenAI caches in 128-token steps, DeepSeek 64; an explicit
  breakpoint caches exactly what it marks, a step of 1);
- the **TTL** of each tier: a fresh anchor written, left alone for ``d``, read
  again; a search over ``d`` until the bracket is within ``precision``;
- whether cache **writes are billed** (an explicit regime reports them).

A fitted :class:`CalibratedProfile` is data: stored as JSON, applied over the
documented profile by :func:`apply`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from manifest.planner import CapabilityProfile


@dataclass
class Search:
    """The smallest value in ``[low, high]`` where a monotone probe succeeds.

    Grows ``high`` by ``factor`` until a probe succeeds (or ``cap`` fails), then
    bisects until ``done``: integers to adjacent values, reals to ``precision``
    relative width.  ``ok`` is the smallest success seen, ``fail`` the largest
    failure below it.
    """

    start: float
    cap: float
    factor: float = 2.0
    integer: bool = True
    precision: float = 0.0
    fail: float | None = None
    ok: float | None = None

    def next(self) -> float | None:
        """The next value to probe, or None when the search is over."""
        if self.ok is None:  # grow until a probe succeeds
            if self.fail is not None and self.fail >= self.cap:
                return None
            nxt = self.start if self.fail is None else self.fail * self.factor
            return self._round(min(nxt, self.cap))
        if self.fail is None:  # every probe succeeded: shrink until one fails
            if self.ok <= (1 if self.integer else self.start * 1e-6):
                return None
            nxt = self._round(self.ok / self.factor)
            return None if nxt >= self.ok else nxt
        if self.integer and self.ok - self.fail <= 1:
            return None
        if not self.integer and (self.ok - self.fail) / self.fail <= self.precision:
            return None
        mid = self._round((self.fail + self.ok) / 2)
        return None if mid in (self.fail, self.ok) else mid

    def record(self, value: float, succeeded: bool) -> None:
        if succeeded:
            self.ok = value if self.ok is None else min(self.ok, value)
        else:
            self.fail = value if self.fail is None else max(self.fail, value)

    def _round(self, v: float) -> float:
        return float(math.ceil(v)) if self.integer else v

    @property
    def estimate(self) -> float | None:
        """The bracket's middle (reals) or its smallest success (integers)."""
        if self.ok is None:
            return None
        if self.integer or self.fail is None:
            return self.ok
        return (self.fail + self.ok) / 2


def fit_granularity(cached: list[int], minimum: int) -> int | None:
    """The cache step: gcd of (cached - minimum) over probes that cached past the minimum
    (None: no probe went past it)."""
    steps = [c - minimum for c in cached if c > minimum]
    if not steps:
        return None
    g = 0
    for s in steps:
        g = math.gcd(g, s)
    return g


@dataclass(frozen=True)
class CalibratedProfile:
    target: str  # provider/model
    min_prefix_tokens: int
    granularity: int
    ttl_s: float
    ttl_long_s: float | None  # Anthropic's 1h tier, when probed
    writes_billed: bool
    probes: int  # requests the calibration sent
    fitted_at: float  # wall-clock seconds
    notes: tuple[str, ...] = field(default=())

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> CalibratedProfile:
        raw: dict[str, Any] = json.loads(text)
        raw["notes"] = tuple(raw.get("notes") or ())
        return cls(**raw)


def apply(profile: CapabilityProfile, cal: CalibratedProfile) -> CapabilityProfile:
    """The documented profile with the fitted rules in place of the constants."""
    ttls = (round(cal.ttl_s),) + ((round(cal.ttl_long_s),) if cal.ttl_long_s else ())
    return dataclasses.replace(
        profile,
        min_prefix_tokens=cal.min_prefix_tokens,
        granularity=max(1, cal.granularity),
        ttl_options_s=ttls if profile.ttl_options_s else profile.ttl_options_s,
    )
