"""KV routing under cache pressure: vcache's policies, an oracle, and vllm-router.

    .venv/bin/python -m loadtests.routing_pressure --vllm-router /path/to/vllm-router

The workload's shared prefixes exceed one replica's KV cache but fit in the
two together: ``--groups`` system prompts of ``--system-tokens`` each,
uniform popularity by default (what a cache that holds part of it serves
worst).  Arms, each from a cold prefix set (a new run id):

- ``vcache serve --replicas 2 --kv-cache-bytes K`` under ``kv``,
  ``round_robin`` and ``least_loaded`` routing (the admin header
  ``x-vcache-routing``) and an oracle that pins group g to replica g mod 2
  (``x-vcache-replica``): the gateway has an admin key (admin_key.py), which
  every request sends;
- vllm-router's ``cache_aware`` policy in front of two plain vLLM OpenAI
  servers with the same model and the same KV size (``--vllm-router``; the
  router installs from PyPI into a venv of its own).

Per arm: token-weighted hit rate (the engines' ``cached_tokens``), TTFT
p50/p90, and for vcache the prediction error (the ``predicted`` header
against what the engine reported), the gateway's own count of exact,
approximate and missed predictions with their causes, the waits for a
running prefill of a request's blocks (JSON: ``prefill_waits``), and what
the holds cost (``/metrics`` before and after the arm: holds by outcome, blocks per
hold, mean hold time, hold time p99 as its histogram bucket's bound).
Prints a table, writes JSON, exits 1 on a missed target (kv at least 1.8x
round_robin, at least 95 % of the oracle, ahead of vllm-router).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from loadtests.admin_key import admin_env, bearer, locust_env
from loadtests.procs import free_port, get_ok, run_locust, serving, vllm_router
from loadtests.report import read_raw, summarize
from loadtests.run import token_counter
from loadtests.workloads import shared_prefix

VCACHE_ARMS = ("kv", "round_robin", "least_loaded", "oracle")


def prediction(rows: list[dict[str, str]]) -> dict[str, Any]:
    pairs = [
        (int(r["predicted_cached_tokens"]), int(r["cached_tokens"] or 0))
        for r in rows
        if r.get("ok") == "1" and r.get("predicted_cached_tokens") not in (None, "", "None")
    ]
    if not pairs:
        return {"predicted": 0, "exact_share": None, "mean_abs_error_tokens": None}
    exact = sum(p == a for p, a in pairs)
    return {
        "predicted": len(pairs),
        "exact_share": exact / len(pairs),
        "mean_abs_error_tokens": sum(abs(p - a) for p, a in pairs) / len(pairs),
    }


HOLD_SERIES = (
    "vcache_prediction_results_total",
    "vcache_prefill_waits_total",
    "vcache_kv_holds_total",
    "vcache_kv_hold_blocks_total",
    "vcache_kv_hold_seconds_bucket",
    "vcache_kv_hold_seconds_count",
    "vcache_kv_hold_seconds_sum",
)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def series(text: str) -> dict[str, float]:
    """The prediction and hold series of a Prometheus exposition, by name with labels."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(HOLD_SERIES):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def scrape(host: str) -> dict[str, float]:
    return series(httpx.get(f"{host}/metrics", headers=bearer(), timeout=10).text)


def hold_cost(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """What an arm's predictions and holds were, from the gateway's series before and after
    it: results by ``result:cause``, holds by outcome, blocks per hold, hold time."""
    diff = {k: v - before.get(k, 0.0) for k, v in after.items()}
    results: dict[str, int] = {}
    holds: dict[str, int] = {}
    waits: dict[str, int] = {}  # routed requests that waited for a prefill of their blocks
    buckets: list[tuple[float, float]] = []
    blocks = 0.0
    for key, v in diff.items():
        labels = dict(_LABEL.findall(key))
        if key.startswith("vcache_prediction_results_total") and v:
            results[f"{labels['result']}:{labels['cause']}".rstrip(":")] = int(v)
        elif key.startswith("vcache_prefill_waits_total") and v:
            waits[labels["outcome"]] = int(v)
        elif key.startswith("vcache_kv_holds_total") and v:
            holds[labels["outcome"]] = holds.get(labels["outcome"], 0) + int(v)
        elif key.startswith("vcache_kv_hold_blocks_total"):
            blocks += v
        elif key.startswith("vcache_kv_hold_seconds_bucket"):
            buckets.append((float(labels["le"]), v))
    count = diff.get("vcache_kv_hold_seconds_count", 0.0)
    p99 = None
    for le, cum in sorted(buckets):
        if count and cum >= 0.99 * count:
            p99 = le  # the bucket's upper bound
            break
    held = holds.get("held", 0)
    return {
        "results": results,
        "holds": holds,
        "prefill_waits": waits,
        "blocks_held": int(blocks),
        "blocks_per_hold": blocks / held if held else None,
        "hold_mean_s": diff.get("vcache_kv_hold_seconds_sum", 0.0) / count if count else None,
        "hold_p99_s_at_most": p99,
    }


def arm(name: str, host: str, out: Path, args: argparse.Namespace, env: dict[str, str]) -> Any:
    run_id = f"{name}-{time.time_ns():x}"
    w = shared_prefix(
        args.groups,
        args.system_tokens,
        40,
        8,
        args.requests,
        args.skew,
        args.seed,
        run_id,
        args.count,
    )
    wdir = out / name
    wdir.mkdir(parents=True, exist_ok=True)
    w.dump(wdir / "workload.json")
    before = scrape(host) if name != "vllm_router" else {}
    elapsed = run_locust(wdir / "workload.json", host, wdir, env, args.users, args.limit_s)
    rows = read_raw(wdir / "raw.csv")
    s = summarize(rows, elapsed)
    holds = hold_cost(before, scrape(host)) if name != "vllm_router" else None
    return {
        "arm": name,
        "requests": s["requests"],
        "errors": s["errors"],
        "hit_rate": round(s["hit_rate"], 4),
        "ttft_ms": s["ttft_ms"],
        "prediction": prediction(rows),
        "holds": holds,
    }


def vcache_arms(out: Path, args: argparse.Namespace) -> list[Any]:
    port = free_port()
    host = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port)]
    cmd += ["--grpc-port", str(free_port()), "--replicas", "2"]
    cmd += ["--kv-cache-bytes", str(args.kv_bytes), "--max-model-len", "4096"]
    env = {**os.environ, "VCACHE_DATA_DIR": str(out / "vcache-data"), **admin_env()}
    rows = []
    with serving(cmd, lambda: get_ok(f"{host}/readyz"), out / "vcache.log", env):
        for name in args.arms.split(","):
            rows.append(arm(name, host, out, args, arm_env(name)))
            print(f"{name}: hit {rows[-1]['hit_rate']}", flush=True)
    return rows


def arm_env(name: str) -> dict[str, str]:
    """The locust users' environment in a vcache arm: the routing headers it sends (an
    admin's) and the admin key."""
    extra = {"VCACHE_MODEL": "vcache-demo", **locust_env()}
    if name == "oracle":
        extra["VCACHE_ORACLE_REPLICAS"] = "2"
    else:
        extra["VCACHE_ROUTING"] = name
    return extra


def router_arm(out: Path, args: argparse.Namespace, model: str) -> Any:
    with vllm_router(out, args.vllm_router, model, args.kv_bytes, 4096, []) as host:
        row = arm("vllm_router", host, out, args, {"VCACHE_MODEL": "vcache-demo"})
    print(f"vllm_router: hit {row['hit_rate']}", flush=True)
    return row


def table(rows: list[Any]) -> str:
    lines = [
        f"{'arm':<14}{'req':>5}{'err':>5}{'hit':>8}{'ttft p50':>10}{'p90':>8}"
        f"{'predicted exact':>17}{'mean |err| tok':>16}{'said approx':>13}{'blk/hold':>10}"
        f"{'hold ms':>9}{'hold p99 s':>12}"
    ]
    for r in rows:
        t, p = r["ttft_ms"], r["prediction"]
        exact = "-" if p["exact_share"] is None else f"{p['exact_share']:.3f}"
        err = "-" if p["mean_abs_error_tokens"] is None else f"{p['mean_abs_error_tokens']:.1f}"
        h = r.get("holds") or {}
        said = sum(n for k, n in h.get("results", {}).items() if k.startswith("approximate"))
        approx = f"{said}" if h else "-"
        per = "-" if h.get("blocks_per_hold") is None else f"{h['blocks_per_hold']:.1f}"
        mean = "-" if h.get("hold_mean_s") is None else f"{h['hold_mean_s'] * 1000:.0f}"
        p99 = "-" if h.get("hold_p99_s_at_most") is None else f"<={h['hold_p99_s_at_most']:g}"
        lines.append(
            f"{r['arm']:<14}{r['requests']:>5}{r['errors']:>5}{r['hit_rate']:>8.3f}"
            f"{t['p50'] or 0:>10.0f}{t['p90'] or 0:>8.0f}{exact:>17}{err:>16}{approx:>13}"
            f"{per:>10}{mean:>9}{p99:>12}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--vllm-router", default=None, help="the vllm-router executable")
    ap.add_argument("--groups", type=int, default=30)
    ap.add_argument("--system-tokens", type=int, default=1536)
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--skew", type=float, default=0.0)
    ap.add_argument("--kv-bytes", type=int, default=48 << 20, help="per replica")
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--limit-s", type=int, default=900)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument(
        "--arms", default=",".join(VCACHE_ARMS), help="vcache arms to run, comma-separated"
    )
    ap.add_argument(
        "--out", type=Path, default=Path("reports") / time.strftime("routing-%Y%m%d-%H%M%S")
    )
    args = ap.parse_args(argv)
    unknown = set(args.arms.split(",")) - set(VCACHE_ARMS)
    if unknown:
        ap.error(f"unknown arms {sorted(unknown)}; choose from {', '.join(VCACHE_ARMS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    args.count = token_counter(None)
    from gateway.core.config import Settings
    from gateway.local.build import resolve_model

    model = resolve_model(Settings())
    rows = vcache_arms(args.out, args)
    if args.vllm_router:
        rows.append(router_arm(args.out, args, model))
    text = table(rows)
    print(text)
    hit = {r["arm"]: r["hit_rate"] for r in rows}
    checks = {}
    if {"kv", "round_robin"} <= hit.keys():
        checks["kv >= 1.8x round_robin"] = hit["kv"] >= 1.8 * hit["round_robin"]
    if {"kv", "oracle"} <= hit.keys():
        checks["kv >= 95% of oracle"] = hit["kv"] >= 0.95 * hit["oracle"]
    if {"kv", "vllm_router"} <= hit.keys():
        checks["kv ahead of vllm-router"] = hit["kv"] > hit["vllm_router"]
    for name, ok in checks.items():
        print(f"{name}: {'ok' if ok else 'MISSED'}")
    (args.out / "routing.json").write_text(
        json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "arms": rows}, indent=2)
    )
    (args.out / "routing.txt").write_text(text + "\n")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
