"""The vcache dashboard as a static page, from a real run: scrape a gateway's /metrics
while load runs, then draw the panels of deploy/grafana/dashboards/vcache.json
(the same series, computed over each scrape interval) into one PNG.

    .venv/bin/python -m loadtests.dashboard --url http://127.0.0.1:8000 \\
        --seconds 180 --out docs/dashboard.png

For a machine without Grafana; with the compose stack, Grafana draws the same.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import re
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import httpx

from loadtests.report import histogram, histogram_quantile, parse_metrics

Sample = dict[str, float]
Series = dict[str, list[float]]


def scrape(url: str, seconds: float, interval: float) -> list[tuple[float, Sample]]:
    """``/metrics`` every ``interval`` seconds for ``seconds`` (time since the first)."""
    out: list[tuple[float, Sample]] = []
    t0 = time.monotonic()
    with httpx.Client(timeout=10) as c:
        while time.monotonic() - t0 < seconds:
            with contextlib.suppress(httpx.HTTPError):  # busy or restarting: a gap in the lines
                out.append((time.monotonic() - t0, parse_metrics(c.get(f"{url}/metrics").text)))
            time.sleep(interval)
    return out


def _labels(key: str) -> dict[str, str]:
    return dict(re.findall(r'(\w+)="([^"]*)"', key))


def _sum(s: Sample, name: str, **match: str) -> float:
    if not match and name in s:  # unlabelled, or the total ``parse_metrics`` adds
        return s[name]
    total = 0.0
    for key, value in s.items():
        base, labelled, _ = key.partition("{")
        if base == name and labelled and all(_labels(key).get(k) == v for k, v in match.items()):
            total += value
    return total


def _by(s: Sample, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in s.items():
        base, labelled, _ = key.partition("{")
        if base == name and labelled:
            group = _labels(key).get(label, "")
            out[group] = out.get(group, 0.0) + value
    return out


def _quantile(prev: Sample, cur: Sample, name: str, q: float) -> float | None:
    """``histogram_quantile`` of the buckets' increase over one interval."""
    buckets, _, _ = histogram(prev, cur, name, "")
    return histogram_quantile(buckets, q)


Panel = tuple[str, Callable[[Sample, Sample, float], Mapping[str, float | None]]]


def _rate(name: str, **match: str) -> Callable[[Sample, Sample, float], float]:
    return lambda p, c, dt: (_sum(c, name, **match) - _sum(p, name, **match)) / dt


def _ratio(num: Callable[..., float], den: Callable[..., float]) -> Callable[..., float | None]:
    def f(p: Sample, c: Sample, dt: float) -> float | None:
        d = den(p, c, dt)
        return num(p, c, dt) / d if d > 0 else None

    return f


def _rates_by(name: str, label: str) -> Callable[[Sample, Sample, float], dict[str, float]]:
    def f(p: Sample, c: Sample, dt: float) -> dict[str, float]:
        before = _by(p, name, label)
        return {k: (v - before.get(k, 0.0)) / dt for k, v in _by(c, name, label).items()}

    return f


PANELS: list[Panel] = [
    (
        "Prefix-cache hit rate",
        lambda p, c, dt: {
            "hit rate": _ratio(
                _rate("vcache_cached_tokens_total"), _rate("vcache_prompt_tokens_total")
            )(p, c, dt)
        },
    ),
    (
        "Predicted == actual cached tokens",
        lambda p, c, dt: {
            "matched": _ratio(
                _rate("vcache_cached_token_predictions_total", outcome="matched"),
                _rate("vcache_cached_token_predictions_total"),
            )(p, c, dt)
        },
    ),
    (
        "Time to first token (s)",
        lambda p, c, dt: {
            "p50": _quantile(p, c, "vcache_ttft_seconds", 0.5),
            "p90": _quantile(p, c, "vcache_ttft_seconds", 0.9),
        },
    ),
    (
        "Inter-token latency p50 (s)",
        lambda p, c, dt: {"p50": _quantile(p, c, "vcache_inter_token_latency_seconds", 0.5)},
    ),
    (
        "Engine queue",
        lambda p, c, dt: {
            "waiting": _sum(c, "vcache_engine_core_waiting_requests"),
            "running": _sum(c, "vcache_engine_core_running_requests"),
        },
    ),
    (
        "KV cache usage by replica",
        lambda p, c, dt: _by(c, "vcache_engine_kv_cache_usage_ratio", "replica"),
    ),
    (
        "Engine queue time (s)",
        lambda p, c, dt: {
            "p50": _quantile(p, c, "vcache_queue_time_seconds", 0.5),
            "p90": _quantile(p, c, "vcache_queue_time_seconds", 0.9),
        },
    ),
    (
        "Requests/s by status",
        lambda p, c, dt: _rates_by("vcache_requests_total", "status")(p, c, dt),
    ),
    (
        "Routing decisions/s by reason",
        lambda p, c, dt: _rates_by("vcache_routing_decisions_total", "reason")(p, c, dt),
    ),
    (
        "Prompt and cached tokens/s",
        lambda p, c, dt: {
            "prompt": _rate("vcache_prompt_tokens_total")(p, c, dt),
            "cached": _rate("vcache_cached_tokens_total")(p, c, dt),
        },
    ),
]


def series(samples: list[tuple[float, Sample]]) -> tuple[list[float], dict[str, Series]]:
    """Each panel's lines, one point per scrape interval (time: its end)."""
    times: list[float] = []
    out: dict[str, Series] = {title: {} for title, _ in PANELS}
    for (t0, prev), (t1, cur) in itertools.pairwise(samples):
        times.append(t1)
        for title, f in PANELS:
            values = f(prev, cur, max(t1 - t0, 1e-6))
            lines = out[title]
            for name in values:
                lines.setdefault(name, [float("nan")] * (len(times) - 1))
            for name in lines:
                v = values.get(name)
                lines[name].append(float("nan") if v is None else float(v))
    return times, out


def _traffic(panels: dict[str, Series]) -> list[float]:
    """Requests/s per interval, all statuses (for the time axis: idle tails are cut)."""
    by_status = panels.get("Requests/s by status", {})
    n = max((len(v) for v in by_status.values()), default=0)
    return [sum(v[i] for v in by_status.values() if v[i] == v[i]) for i in range(n)]


def draw(times: list[float], panels: dict[str, Series], title: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = -(-len(panels) // 3)
    fig, axes = plt.subplots(rows, 3, figsize=(18, 3.7 * rows), constrained_layout=True)
    fig.suptitle(title, fontsize=14)
    busy = [t for t, r in zip(times, _traffic(panels), strict=True) if r > 0]
    right = (max(busy) + 10) if busy else (times[-1] if times else 1)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, (name, lines) in zip(axes.flat, panels.items(), strict=False):
        for label, ys in sorted(lines.items()):
            # markers: an interval with traffic between idle ones is one point, not a line
            ax.plot(times, ys, label=label or "-", linewidth=1.4, marker="o", markersize=3)
        ax.set_title(name, fontsize=11)
        ax.set_xlim(0, right)
        ax.set_xlabel("seconds since the first scrape")
        ax.grid(alpha=0.3)
        if lines:
            ax.legend(fontsize=8, loc="best")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--seconds", type=float, default=180)
    ap.add_argument("--interval", type=float, default=3)
    ap.add_argument("--out", type=Path, default=Path("reports/dashboard.png"))
    ap.add_argument("--title", default="vcache — a load-test run (demo model, CPU vLLM)")
    ap.add_argument("--redraw", type=Path, help="draw again from a run's saved JSON")
    args = ap.parse_args()
    if args.redraw is not None:
        saved = json.loads(args.redraw.read_text())
        draw(saved["times"], saved["panels"], args.title, args.out)
        print(f"wrote {args.out}")
        return 0
    samples = scrape(args.url, args.seconds, args.interval)
    if len(samples) < 2:
        print("fewer than two scrapes: is the gateway up?", file=sys.stderr)
        return 1
    times, panels = series(samples)
    draw(times, panels, args.title, args.out)
    args.out.with_suffix(".json").write_text(json.dumps({"times": times, "panels": panels}))
    print(f"wrote {args.out} ({len(samples)} scrapes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
