"""The control loop's view of the observed provider traffic (``GET /v1/cache/plan``):
per target the skew, coverage, warm-set size inside the rate-limit headroom, the
break-evens and each anchor's decision (design note §5); the agent sessions' tips."""

from __future__ import annotations

from typing import Any

from gateway.providers.control import Anchor, Control, economics
from manifest.economics import dedicated_warm_break_even, warm_set_size, zipf_coverage, zipf_fit


def plan(c: Control) -> dict[str, Any]:
    """The observed traffic's economics (design note §5): skew, coverage, warm-set size
    inside the rate-limit headroom, break-evens, and each anchor's decision."""
    now = c.clock()
    out: dict[str, Any] = {"mode": c.cfg.mode, "counts": dict(c.counts), "targets": {}}
    out["session_tips"] = c.tips.snapshot()
    for name, t in c.targets.items():
        mine = [a for a in c.anchors.values() if a.target == name]
        counts = [len(a.arrivals.times) for a in mine]
        s = zipf_fit(counts)
        econ = economics(t, c.cfg.latency_value)
        tokens = sorted(a.tokens for a in mine)
        median = tokens[len(tokens) // 2] if tokens else 0
        lim = t.client.limits
        warm_set = None
        if lim is not None and lim.requests_remaining is not None and median:
            tpm = lim.tokens_remaining if lim.tokens_remaining is not None else 10**12
            warm_set = warm_set_size(
                lim.requests_remaining, tpm, median, econ.options[0].ttl_s / 60
            )
        v = len(mine)
        coverage = {
            str(n): round(zipf_coverage(n, v, s), 3)
            for n in (1, 5, 10, 50)
            if s is not None and n <= v
        }
        out["targets"][name] = {
            "anchors": v,
            "zipf_s": None if s is None else round(s, 3),
            "coverage_top_n": coverage,
            "median_anchor_tokens": median,
            "warm_set_size": None if warm_set is None else round(warm_set, 1),
            "break_even_reuse": {
                f"{o.ttl_s:g}s": dedicated_warm_break_even(o.write_mult, econ.read_mult)
                for o in econ.options
            },
            "decisions": _decisions(c, mine, now),
        }
    return out


def _decisions(c: Control, anchors: list[Anchor], now: float) -> list[dict[str, Any]]:
    rows = []
    for a in sorted(anchors, key=lambda a: -a.arrivals.rate(now))[:50]:
        v = a.verdict or c.verdict(a, now)
        rows.append(
            {
                "anchor": a.digest[:16],
                "tenant": a.tenant,
                "tokens": a.tokens,
                "arrivals_per_hour": round(a.arrivals.rate(now) * 3600, 2),
                "decision": v.decision.value,
                "ttl_s": v.ttl_s,
                "heartbeats": a.heartbeats,
            }
        )
    return rows
