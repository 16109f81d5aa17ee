"""The design note's quantitative laws (shared/seeds/001, §5 and §10).

Pure functions; names are stable so tools and reports can call them.
"""

from __future__ import annotations

import math


def _harmonic(n: int, s: float) -> float:
    """Generalized harmonic number H(n, s) = sum_{i=1..n} i^-s."""
    return math.fsum(i**-s for i in range(1, n + 1))


def zipf_coverage(n: int, v: int, s: float) -> float:
    """Share of traffic covered by the top ``n`` of ``v`` prefixes under Zipf(s): H(n,s)/H(v,s)."""
    if not 0 <= n <= v or v < 1:
        raise ValueError("need 0 <= n <= v and v >= 1")
    return _harmonic(n, s) / _harmonic(v, s)


def zipf_skew_for_coverage(n: int, v: int, coverage: float) -> float:
    """The skew s at which the top ``n`` of ``v`` prefixes cover ``coverage`` (bisection).

    Coverage grows monotonically with s for n < v, so the root is unique.
    """
    if not 0 < coverage < 1 or not 0 < n < v:
        raise ValueError("need 0 < coverage < 1 and 0 < n < v")
    lo, hi = 0.0, 16.0
    if zipf_coverage(n, v, hi) < coverage:
        raise ValueError("coverage not reachable")
    for _ in range(100):
        mid = (lo + hi) / 2
        if zipf_coverage(n, v, mid) < coverage:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def dedicated_warm_break_even(write_mult: float, read_mult: float) -> int:
    """Smallest reuse count k with k > w/(1-r): above it a dedicated warm pays.

    Anthropic 5-minute TTL (w=1.25, r=0.1) gives 2; 1-hour TTL (w=2.0) gives 3.
    """
    if not 0 <= read_mult < 1:
        raise ValueError("read multiplier must be in [0, 1)")
    bound = write_mult / (1 - read_mult)
    return math.floor(bound) + 1


def chain_horizon(min_prefix_tokens: int, unit_tokens: int) -> int:
    """Units of ``unit_tokens`` needed before any caching is possible: ceil(M/u)."""
    if unit_tokens <= 0:
        raise ValueError("unit_tokens must be positive")
    return -(-min_prefix_tokens // unit_tokens)


def warm_set_size(
    rpm_available: float, tpm_available: float, prefix_tokens: int, ttl_minutes: float
) -> float:
    """Anchors that can be kept warm inside the rate-limit headroom: min(R, X/P)·T."""
    if prefix_tokens <= 0:
        raise ValueError("prefix_tokens must be positive")
    return min(rpm_available, tpm_available / prefix_tokens) * ttl_minutes


def rpm_tpm_crossover(rpm_available: float, tpm_available: float) -> float:
    """Prefix size P* = X/R above which warming is token-bound rather than request-bound."""
    if rpm_available <= 0:
        raise ValueError("rpm_available must be positive")
    return tpm_available / rpm_available


def pin_pays(
    arrivals_per_ttl: float, write_mult: float, latency_value: float, shadow_price: float
) -> bool:
    """§10's reframed rule: keep a prefix pinned iff λT > ln((W + μ + L) / L)."""
    if latency_value <= 0:
        return False  # on pure cache dollars lazy rebuild weakly dominates
    return arrivals_per_ttl > math.log((write_mult + shadow_price + latency_value) / latency_value)


def zipf_fit(counts: list[int]) -> float | None:
    """The Zipf exponent ``s`` of anchor popularity, by maximum likelihood.

    ``counts``: requests per anchor (any order).  The ranks are the order by count;
    the root of d/ds log L = -Σ c_r ln r + N · Σ_i i^-s ln i / H(V, s) is found by
    bisection on [0, 8].  None with fewer than two anchors or one request.
    """
    ranked = sorted((c for c in counts if c > 0), reverse=True)
    v, n = len(ranked), sum(ranked)
    if v < 2 or n < 2:
        return None
    observed = math.fsum(c * math.log(r) for r, c in enumerate(ranked, start=1)) / n

    def expected(s: float) -> float:  # E[ln rank] under Zipf(s) over v ranks
        weights = [i**-s for i in range(1, v + 1)]
        return math.fsum(w * math.log(i) for i, w in enumerate(weights, start=1)) / math.fsum(
            weights
        )

    lo, hi = 0.0, 8.0
    if expected(lo) <= observed + 1e-12:
        return 0.0  # flatter than uniform: no skew to exploit
    if expected(hi) >= observed:
        return hi
    for _ in range(60):
        mid = (lo + hi) / 2
        if expected(mid) > observed:  # E[ln r] falls as s grows
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def recall_pays(prefix_tokens: int, unit_tokens: int, siblings: int, read_mult: float) -> bool:
    """§11.0's cost gate on recall by rebuild: replaying a ``prefix_tokens`` prefix (read
    at ``read_mult`` of the input price) so ``siblings`` units of ``unit_tokens`` each read
    it from cache pays only when k*u*(1 - r) > P*r.  One 10-token unit under a 30k-token
    prefix at r = 0.1: 9 < 3000, refused (the 300x loss); the same prefix pays from 334
    siblings recalled together while it is hot."""
    if not 0 <= read_mult < 1:
        raise ValueError("read multiplier must be in [0, 1)")
    if prefix_tokens < 0 or unit_tokens < 0 or siblings < 0:
        raise ValueError("token counts and siblings must be >= 0")
    return siblings * unit_tokens * (1 - read_mult) > prefix_tokens * read_mult
