"""Summaries of a load-test run, from the raw per-request CSV and Prometheus deltas."""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any


def percentile(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile (p in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[rank - 1]


def read_raw(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def summarize(rows: Iterable[Mapping[str, str]], duration_s: float) -> dict[str, Any]:
    rows = list(rows)
    ok = [r for r in rows if r.get("ok") == "1"]
    prompt = sum(int(r["prompt_tokens"] or 0) for r in ok)
    cached = sum(int(r["cached_tokens"] or 0) for r in ok)
    ttft = [float(r["ttft_ms"]) for r in ok]
    itl = [float(r["itl_mean_ms"]) for r in ok if float(r["itl_mean_ms"] or 0) > 0]
    by_label: dict[str, list[float]] = {}
    for r in ok:
        by_label.setdefault(r["label"], []).append(float(r["ttft_ms"]))
    return {
        "requests": len(ok),
        "errors": len(rows) - len(ok),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else 0.0,  # token-weighted
        "ttft_ms": {
            "p50": percentile(ttft, 50),
            "p90": percentile(ttft, 90),
            "p99": percentile(ttft, 99),
        },
        "itl_ms": {"p50": percentile(itl, 50), "p99": percentile(itl, 99)},
        "requests_per_s": len(ok) / duration_s if duration_s > 0 else 0.0,
        "ttft_p50_ms_by_label": {k: percentile(v, 50) for k, v in sorted(by_label.items())},
    }


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as ``{sample: value}``, each sample keyed as exposed
    (``name{labels}``); a labelled metric also gets its total over every label set
    under its bare name (``vcache_prompt_tokens_total``: all replicas)."""
    out: dict[str, float] = {}
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
            if "{" in name:
                base = name.split("{", 1)[0]
                totals[base] = totals.get(base, 0.0) + float(value)
    for base, total in totals.items():
        out.setdefault(base, total)
    return out


def counter_cross_check(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, Any]:
    """Hit rates from the gateway's and the engines' own counters over the run."""

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    prompt = delta("vcache_prompt_tokens_total")
    cached = delta("vcache_cached_tokens_total")
    queries = delta("vcache_engine_prefix_cache_queries_total")
    hits = delta("vcache_engine_prefix_cache_hits_total")
    return {
        "gateway_prompt_tokens": prompt,
        "gateway_cached_tokens": cached,
        "gateway_hit_rate": cached / prompt if prompt else 0.0,
        "engine_prefix_cache_queries": queries,
        "engine_prefix_cache_hits": hits,
        "engine_hit_rate": hits / queries if queries else 0.0,
    }


def histogram(
    before: Mapping[str, float], after: Mapping[str, float], name: str, labels: str
) -> tuple[list[tuple[float, float]], float, float]:
    """What a Prometheus histogram gained between two scrapes, over its series whose
    labels contain ``labels``: cumulative ``(le, count)`` buckets, the sum, the count."""
    buckets: dict[float, float] = {}
    for key, value in after.items():
        if key.startswith(f"{name}_bucket{{") and labels in key:
            le = key.split('le="', 1)[1].split('"', 1)[0]
            bound = math.inf if le == "+Inf" else float(le)
            buckets[bound] = buckets.get(bound, 0.0) + value - before.get(key, 0.0)

    def grew(suffix: str) -> float:
        keys = [k for k in after if k.startswith(f"{name}_{suffix}{{") and labels in k]
        return sum(after[k] - before.get(k, 0.0) for k in keys)

    return sorted(buckets.items()), grew("sum"), grew("count")


def histogram_quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """The q-quantile (0..1) of cumulative buckets, linear within a bucket as
    Prometheus's ``histogram_quantile`` does (the last finite bound past it)."""
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return None
    rank, lo, below = q * total, 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lo
            return lo + (le - lo) * ((rank - below) / (count - below) if count > below else 1)
        lo, below = le, count
    return lo


TTFT_PHASES = ("prepare", "gate", "submit", "queue", "prefill", "return")  # gateway/local/ttft.py


def ttft_phases(
    before: Mapping[str, float], after: Mapping[str, float], priority: str
) -> dict[str, dict[str, float | None]]:
    """The gateway's TTFT of one priority's local requests by phase, in a run: each
    phase's mean and p90 (ms; from ``vcache_ttft_phase_seconds``)."""
    out: dict[str, dict[str, float | None]] = {}
    for phase in TTFT_PHASES:
        labels = f'phase="{phase}",priority="{priority}"'
        buckets, total, count = histogram(before, after, "vcache_ttft_phase_seconds", labels)
        p90 = histogram_quantile(buckets, 0.9)
        out[phase] = {
            "mean_ms": 1000 * total / count if count else None,
            "p90_ms": None if p90 is None else 1000 * p90,
            "count": count,
        }
    return out


def phases_table(rows: Iterable[Mapping[str, Any]]) -> str:
    """Per run, where its requests' gateway TTFT went: each phase's mean / p90 in ms."""
    lines = [f"{'run':<17}" + "".join(f"{p:>15}" for p in TTFT_PHASES)]
    for r in rows:
        phases = r.get("phases") or {}
        cells = []
        for p in TTFT_PHASES:
            got = phases.get(p) or {}
            m, q = got.get("mean_ms"), got.get("p90_ms")
            cells.append("-" if m is None else f"{m:.1f} / {q or 0:.0f}")
        lines.append(f"{r['arm']:<17}" + "".join(f"{c:>15}" for c in cells))
    return "\n".join(lines)
