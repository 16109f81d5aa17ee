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
