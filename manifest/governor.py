"""The governor: per anchor, ride natural traffic, heartbeat-pin, rebuild lazily, or evict
(design note §5.4, §10; milestone M5).

Inputs per anchor, all measured: the arrival rate ``λ`` (requests per second that
share the anchor), and per TTL option of the target its TTL ``T`` and write
multiplier ``W``; per deployment the latency value ``L`` of a warm first token
(token-equivalents per anchor token) and the rate-limit shadow price ``μ`` (what
one more request costs while the provider's headroom is short).

The rule, per TTL option:

- ``λT ≥ 1``: traffic keeps the anchor warm by itself (**ride**);
- ``λT > ln((W + μ + L) / L)``: keep it warm with heartbeats (**heartbeat**);
- otherwise rebuild it on the next arrival (**lazy**);
- no arrival within the horizon: forget it (**evict**).

Among the TTL options (Anthropic's 5 minutes and 1 hour) the one with the lower
expected cost rate is taken.  Costs are in token-equivalents per second per
anchor token: a write costs ``W``, a read ``r``, a heartbeat a read (a read
refreshes the TTL), and each miss the latency value ``L`` on top.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum


class Decision(StrEnum):
    RIDE = "ride"
    HEARTBEAT = "heartbeat"
    LAZY = "lazy"
    EVICT = "evict"


@dataclass(frozen=True)
class TtlOption:
    ttl_s: float
    write_mult: float


@dataclass(frozen=True)
class Economics:
    """What a target's cache costs and what a warm first token is worth."""

    read_mult: float
    options: tuple[TtlOption, ...]
    latency_value: float = 1.0  # L: token-equivalents per anchor token of a cold first token
    writes_billed: bool = True  # implicit providers write for free (the request itself)

    def __post_init__(self) -> None:
        if not self.options:
            raise ValueError("a target needs at least one TTL option")
        if not 0 <= self.read_mult < 1 or self.latency_value < 0:
            raise ValueError("read multiplier in [0, 1) and a non-negative latency value")


@dataclass(frozen=True)
class Verdict:
    decision: Decision
    ttl_s: float
    cost_rate: float  # expected token-equivalents per second per anchor token
    arrivals_per_ttl: float  # λT under the chosen TTL


def rule(
    arrivals_per_ttl: float, write_mult: float, latency_value: float, shadow: float
) -> Decision:
    """The note's rule for one TTL option (evict is decided by the caller's horizon)."""
    if arrivals_per_ttl >= 1:
        return Decision.RIDE
    if latency_value > 0 and arrivals_per_ttl > math.log(
        (write_mult + shadow + latency_value) / latency_value
    ):
        return Decision.HEARTBEAT
    return Decision.LAZY


def cost_rate(
    decision: Decision, rate: float, option: TtlOption, econ: Economics, shadow: float
) -> float:
    """Expected cost per second per anchor token of ``decision`` under ``option``.

    Lazy (and ride): an arrival after a gap longer than ``T`` (probability
    ``e^{-λT}`` for Poisson arrivals) misses and writes, the rest read.
    Heartbeat: every arrival reads; a heartbeat (a read, plus the shadow price of
    the request) is sent once per ``T``; the anchor is written once per horizon.
    """
    write = option.write_mult if econ.writes_billed else 1.0
    r, ttl = econ.read_mult, option.ttl_s
    if decision is Decision.HEARTBEAT:
        return rate * r + (r + shadow) / ttl
    miss = math.exp(-rate * ttl)
    return rate * (miss * (write + econ.latency_value) + (1 - miss) * r)


def decide(
    rate: float,
    econ: Economics,
    shadow: float = 0.0,
    idle_s: float = 0.0,
    horizon_s: float = 3600.0,
) -> Verdict:
    """The decision for one anchor seen ``rate`` times per second, idle for ``idle_s``."""
    if rate <= 0 or idle_s > horizon_s:
        longest = max(econ.options, key=lambda o: o.ttl_s)
        return Verdict(Decision.EVICT, longest.ttl_s, 0.0, 0.0)
    best: Verdict | None = None
    for option in econ.options:
        lt = rate * option.ttl_s
        decision = rule(lt, option.write_mult, econ.latency_value, shadow)
        cost = cost_rate(decision, rate, option, econ, shadow)
        if best is None or cost < best.cost_rate - 1e-15:
            best = Verdict(decision, option.ttl_s, cost, lt)
    assert best is not None
    return best


@dataclass
class ArrivalRate:
    """Arrivals of one anchor over a sliding horizon: ``λ`` = arrivals in the horizon /
    the time observed (the horizon, or less since the first arrival ever, never less than
    ``floor_s``: one arrival is not an infinite rate).  Times are the caller's clock."""

    horizon_s: float
    floor_s: float
    times: list[float]
    first_seen: float | None = None

    @classmethod
    def empty(cls, horizon_s: float, floor_s: float) -> ArrivalRate:
        return cls(horizon_s, floor_s, [])

    def add(self, now: float) -> None:
        if self.first_seen is None:
            self.first_seen = now
        self.times.append(now)
        self._trim(now)

    def _trim(self, now: float) -> None:
        cut = now - self.horizon_s
        drop = 0
        while drop < len(self.times) and self.times[drop] < cut:
            drop += 1
        if drop:
            del self.times[:drop]

    def rate(self, now: float) -> float:
        self._trim(now)
        if not self.times or self.first_seen is None:
            return 0.0
        span = max(min(self.horizon_s, now - self.first_seen), self.floor_s)
        return len(self.times) / span

    def idle(self, now: float) -> float:
        return now - self.times[-1] if self.times else math.inf
