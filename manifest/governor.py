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

That rule is the closed form for Poisson arrivals, where an arrival finds the
anchor expired (a gap longer than ``T``) with probability ``e^{-λT}``; it
decides when nothing else is known.  Real traffic is bursty or periodic, so
when the caller has measured the anchor's gaps (``miss(T)``: the share of
arrivals that found it expired) the decision is the cheaper of doing nothing
(ride when ``miss(T) ≤ 1/e``, the Poisson-equivalent of ``λT ≥ 1``, else
lazy) and heartbeating, by the cost rates below.

Among the TTL options (Anthropic's 5 minutes and 1 hour) the one with the lower
expected cost rate is taken.  Costs are in token-equivalents per second per
anchor token: a write costs ``W``, a read ``r``, a heartbeat a read (a read
refreshes the TTL), and each miss the latency value ``L`` on top.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
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
    decision: Decision,
    rate: float,
    option: TtlOption,
    econ: Economics,
    shadow: float,
    miss: float | None = None,
) -> float:
    """Expected cost per second per anchor token of ``decision`` under ``option``.

    Lazy (and ride): an arrival after a gap longer than ``T`` (``miss``; Poisson:
    ``e^{-λT}``) misses and writes, the rest read.  Heartbeat: every arrival reads;
    a heartbeat (a read, plus the shadow price of the request) goes once per ``T``.
    """
    write = option.write_mult if econ.writes_billed else 1.0
    r, ttl = econ.read_mult, option.ttl_s
    if decision is Decision.HEARTBEAT:
        return rate * r + (r + shadow) / ttl
    p = math.exp(-rate * ttl) if miss is None else miss
    return rate * (p * (write + econ.latency_value) + (1 - p) * r)


def decide(
    rate: float,
    econ: Economics,
    shadow: float = 0.0,
    idle_s: float = 0.0,
    horizon_s: float = 3600.0,
    miss: Callable[[float], float] | None = None,
    reused: bool = True,
) -> Verdict:
    """The decision for one anchor seen ``rate`` times per second, idle for ``idle_s``;
    ``miss(T)``: the measured share of arrivals that find it expired (None: Poisson).
    An anchor not ``reused`` yet (seen once) is left lazy on the cheapest tier: nothing
    is spent on it before it shows reuse."""
    if rate <= 0 or idle_s > horizon_s:
        longest = max(econ.options, key=lambda o: o.ttl_s)
        return Verdict(Decision.EVICT, longest.ttl_s, 0.0, 0.0)
    if not reused:
        cheapest = min(econ.options, key=lambda o: o.write_mult)
        cost = cost_rate(Decision.LAZY, rate, cheapest, econ, shadow, 1.0)
        return Verdict(Decision.LAZY, cheapest.ttl_s, cost, rate * cheapest.ttl_s)
    best: Verdict | None = None
    for option in econ.options:
        lt = rate * option.ttl_s
        if miss is None:
            decision = rule(lt, option.write_mult, econ.latency_value, shadow)
            cost = cost_rate(decision, rate, option, econ, shadow)
        else:
            p = miss(option.ttl_s)
            idle = cost_rate(Decision.LAZY, rate, option, econ, shadow, p)
            beat = cost_rate(Decision.HEARTBEAT, rate, option, econ, shadow)
            decision = Decision.RIDE if p <= math.exp(-1) else Decision.LAZY
            if beat < idle:
                decision = Decision.HEARTBEAT
            cost = min(idle, beat)
        if best is None or cost < best.cost_rate - 1e-15:
            best = Verdict(decision, option.ttl_s, cost, lt)
    assert best is not None
    return best


RATE_FLOOR_S = 60.0  # an anchor seen once has a rate of at most one per minute


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
    def empty(cls, horizon_s: float, floor_s: float = RATE_FLOOR_S) -> ArrivalRate:
        return cls(horizon_s, floor_s, [])

    def add(self, now: float) -> None:
        """One arrival at ``now``; one that comes late (another gateway's, as it reached
        this one) takes its place in time."""
        if self.first_seen is None or now < self.first_seen:
            self.first_seen = now
        if self.times and now < self.times[-1]:
            bisect.insort(self.times, now)
        else:
            self.times.append(now)
        self._trim(self.times[-1])

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

    def miss(self, ttl_s: float, now: float) -> float:
        """The share of arrivals that found the anchor expired under a TTL of ``ttl_s``:
        gaps longer than it, the open gap once it is longer; 1 before any gap was seen
        (an anchor seen once is not assumed to come back within any TTL)."""
        gaps = [b - a for a, b in zip(self.times, self.times[1:], strict=False)]
        if self.times and now - self.times[-1] > ttl_s:
            gaps.append(now - self.times[-1])
        return sum(g > ttl_s for g in gaps) / len(gaps) if gaps else 1.0

    def verdict(self, econ: Economics, shadow: float, now: float) -> Verdict:
        """:func:`decide` on what these arrivals measured: their rate, idle time and gaps;
        reuse shown once a second arrival is in the horizon."""
        return decide(
            self.rate(now),
            econ,
            shadow,
            self.idle(now),
            self.horizon_s,
            lambda ttl: self.miss(ttl, now),
            reused=len(self.times) >= 2,
        )
