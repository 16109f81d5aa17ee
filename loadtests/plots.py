"""PNG plots of a load-test run: TTFT of hits versus misses, and hit rate over time."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator


def ttft_hits_vs_misses(rows: Sequence[Mapping[str, str]], title: str, path: Path) -> None:
    """TTFT distribution of requests served partly from cache versus not at all."""
    ok = [r for r in rows if r.get("ok") == "1"]
    hits = [float(r["ttft_ms"]) for r in ok if int(r["cached_tokens"] or 0) > 0]
    misses = [float(r["ttft_ms"]) for r in ok if int(r["cached_tokens"] or 0) == 0]
    fig, ax = plt.subplots(figsize=(7, 4))
    values = hits + misses
    lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
    width = (hi - lo) / 30 or 1.0
    bins = [lo + i * width for i in range(31)]  # the same bins for both series
    if misses:
        ax.hist(misses, bins=bins, alpha=0.6, label=f"miss (n={len(misses)})")
    if hits:
        ax.hist(hits, bins=bins, alpha=0.6, label=f"hit (n={len(hits)})")
    ax.set_xlabel("time to first token (ms)")
    ax.set_ylabel("requests")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # counts of requests
    ax.set_title(f"{title}: TTFT, prefix-cache hits vs misses")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_start(rows: Sequence[Mapping[str, str]]) -> float:
    """When the run's first request was sent: rows record ``t`` when a request completed,
    so each one started ``total_ms`` before its ``t``."""
    return min(float(r["t"]) - float(r.get("total_ms") or 0) / 1000 for r in rows)


def hit_rate_curve(rows: Sequence[Mapping[str, str]]) -> tuple[list[float], list[float]]:
    """(seconds since the first request was sent, cumulative hit rate) at each completion."""
    ok = sorted((r for r in rows if r.get("ok") == "1"), key=lambda r: float(r["t"]))
    start = run_start(rows) if rows else 0.0
    xs: list[float] = []
    ys: list[float] = []
    prompt = cached = 0
    for r in ok:
        prompt += int(r["prompt_tokens"] or 0)
        cached += int(r["cached_tokens"] or 0)
        xs.append(float(r["t"]) - start)
        ys.append(cached / prompt if prompt else 0.0)
    return xs, ys


def hit_rate_over_time(rows: Sequence[Mapping[str, str]], title: str, path: Path) -> None:
    """Cumulative token-weighted hit rate against seconds since the first request was sent."""
    xs, ys = hit_rate_curve(rows)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, ys, marker=".")
    ax.set_ylim(0, 1)
    ax.set_xlim(left=0)
    ax.set_xlabel("seconds since the first request was sent")
    ax.set_ylabel("cumulative hit rate (tokens)")
    ax.set_title(f"{title}: hit rate over time")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
