"""The control loop against its alternatives: governor on vs off vs always-heartbeat.

    .venv/bin/python -m loadtests.control_arms [--bursts 10] [--time-scale 60]

Starts the provider emulator with a clock ``--time-scale`` times faster than
real time and a rate limit on Anthropic, then per arm a provider-only gateway
(``control.mode`` off, govern, heartbeat_all; the same clock scale) and runs
locust with the ``bursty`` workload: bursts of requests on Zipf-popular
anchors separated by idle gaps longer than the 5-minute TTL.  Per arm, from
the emulator's bill (requests, warms and 429s included): hit rate (cached /
prompt tokens of the real requests, from locust's rows), token-equivalent
cost (uncached + 0.1 x reads + 1.25 x 5m writes + 2 x 1h writes: Anthropic's
prices), the heartbeats sent and the 429s.  Prints a table and writes JSON.

``--gateways 2`` adds the arm ``govern x2``: the governor on two gateway processes
(``--workers 2`` on one port, so locust's users spread over both) sharing their state
through Redis (``--redis``; a key prefix of the run's own, deleted after): one of them
heartbeats, both plan on every arrival and on the freshest headroom either saw, so
together they stay inside the provider's limit as one gateway does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from loadtests.admin_key import admin_env, bearer, locust_env
from loadtests.procs import free_port, get_ok, run_locust, serving
from loadtests.report import read_raw, summarize
from loadtests.workloads import bursty

HERE = Path(__file__).resolve().parent

ARMS = ("off", "govern", "heartbeat_all")
MODEL = "anthropic/claude-sonnet-4-5"
PRICES = {"uncached": 1.0, "read": 0.1, "write": 1.25, "write_long": 2.0}


def cost(bill: dict[str, int]) -> float:
    return sum(bill.get(k, 0) * m for k, m in PRICES.items())


def _plan(host: str, gateways: int) -> dict[str, Any]:
    """The control loop's plan (the admin API); over several gateways, the one that
    heartbeats (each fresh connection may land on another worker)."""
    plans = []
    for _ in range(4 * gateways - 3):
        with httpx.Client(timeout=10, headers=bearer()) as c:
            r = c.get(f"{host}/v1/cache/plan")
            r.raise_for_status()
            plans.append(r.json())
    return max(plans, key=lambda p: p.get("counts", {}).get("heartbeats", 0))


def run_arm(arm: str, emu: str, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    mode, _, times = arm.partition(" x")
    gateways = int(times or 1)
    httpx.post(f"{emu}/admin/reset", timeout=10).raise_for_status()
    limit = {"provider": "anthropic", "rpm": args.rpm, "tpm": args.tpm}
    httpx.post(f"{emu}/admin/limits", json=limit, timeout=10).raise_for_status()
    port = free_port()
    host = f"http://127.0.0.1:{port}"
    data = Path(tempfile.mkdtemp(prefix=f"vcache-{arm}-"))
    env = {
        **os.environ,
        "PYTHONPATH": str(HERE.parent),
        "VCACHE_DATA_DIR": str(data),
        "VCACHE_ENGINE__REPLICAS": "0",
        "VCACHE_PROVIDERS": json.dumps(
            {"anthropic": {"base_url": f"{emu}/v1", "api_key": "emulator", "max_retries": 2}}
        ),
        "VCACHE_CONTROL__MODE": mode,
        "VCACHE_CONTROL__CLOCK_SCALE": str(args.time_scale),
        "VCACHE_CONTROL__TICK_S": "0.25",
        "VCACHE_CONTROL__FAN_WAIT_S": "2",
        **admin_env(),  # /v1/cache/plan needs an admin key
    }
    if gateways > 1:
        env["VCACHE_STATE__URL"] = args.redis
        env["VCACHE_STATE__PREFIX"] = f"control-arms-{time.time_ns():x}:"
    scale = args.time_scale
    workload = bursty(
        args.anchors,
        args.anchor_tokens,
        args.zipf,
        args.bursts,
        args.per_burst,
        args.gap_s / scale,
        args.burst_s / scale,
        args.seed,
        f"{mode}-{time.time_ns():x}",
    )
    wdir = out / arm.replace(" ", "_")
    wdir.mkdir(parents=True, exist_ok=True)
    workload.dump(wdir / "workload.json")
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port)]
    cmd += ["--grpc-port", str(free_port()), "--workers", str(gateways)]
    with serving(cmd, lambda: get_ok(f"{host}/readyz"), wdir / "gateway.log", env):
        time.sleep(5 if gateways > 1 else 0)  # every worker up, a role taken
        span = max(s.start_s for s in workload.sessions) + 30
        users = {**env, "VCACHE_MODEL": MODEL, **locust_env()}  # the key on every request
        elapsed = run_locust(wdir / "workload.json", host, wdir, users, args.users, int(span))
        time.sleep(args.tail_s)  # heartbeats go on after the last burst: count them too
        plan = _plan(host, gateways)
    bill = httpx.get(f"{emu}/admin/billing", timeout=10).json().get("anthropic", {})
    if gateways > 1:
        _forget(args.redis, env["VCACHE_STATE__PREFIX"])
    summary = summarize(read_raw(wdir / "raw.csv"), elapsed)
    return {
        "arm": arm,
        "requests": summary["requests"],
        "errors": summary["errors"],
        "hit_rate": round(summary["hit_rate"], 4),
        "cost_token_equivalents": round(cost(bill), 1),
        "bill": bill,
        "heartbeats": plan.get("counts", {}).get("heartbeats", 0),
        "held_siblings": plan.get("counts", {}).get("held", 0),
        "deferred_heartbeats": plan.get("counts", {}).get("deferred", 0),
        "rejected_429": bill.get("rejected_429", 0),
        "ttft_ms": summary["ttft_ms"],
    }


def _forget(url: str, prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    keys = list(client.scan_iter(match=f"{prefix}*"))
    if keys:
        client.delete(*keys)
    client.close()


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'arm':<15}{'req':>5}{'err':>5}{'hit':>8}{'cost (tok-eq)':>15}{'vs off':>8}"
        f"{'beats':>7}{'held':>6}{'429s':>6}{'5m writes':>11}{'1h writes':>11}{'reads':>10}"
    )
    base = next((r["cost_token_equivalents"] for r in rows if r["arm"] == "off"), None)
    lines = [head]
    for r in rows:
        b = r["bill"]
        rel = f"{r['cost_token_equivalents'] / base:.2f}" if base else "-"
        lines.append(
            f"{r['arm']:<15}{r['requests']:>5}{r['errors']:>5}{r['hit_rate']:>8.3f}"
            f"{r['cost_token_equivalents']:>15,.0f}{rel:>8}{r['heartbeats']:>7}"
            f"{r['held_siblings']:>6}{r['rejected_429']:>6}{b.get('write', 0):>11,}"
            f"{b.get('write_long', 0):>11,}{b.get('read', 0):>10,}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--time-scale", type=float, default=60.0)
    ap.add_argument("--bursts", type=int, default=10)
    ap.add_argument("--per-burst", type=int, default=12)
    ap.add_argument("--gap-s", type=float, default=900.0, help="between bursts (emulated s)")
    ap.add_argument("--burst-s", type=float, default=60.0, help="a burst's spread (emulated s)")
    ap.add_argument("--anchors", type=int, default=24)
    ap.add_argument("--anchor-tokens", type=int, default=2500)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--users", type=int, default=16)
    ap.add_argument("--rpm", type=int, default=60, help="emulated requests per minute")
    ap.add_argument("--tpm", type=int, default=120_000, help="emulated input tokens per minute")
    ap.add_argument("--tail-s", type=float, default=5.0, help="real seconds after the last burst")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--gateways", type=int, default=1, help="2: also the arm 'govern x2'")
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0", help="for 'govern x2'")
    ap.add_argument(
        "--out", type=Path, default=Path("reports") / time.strftime("control-%Y%m%d-%H%M%S")
    )
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    emu = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "loadtests.emulator", "--port", str(port)]
    cmd += ["--time-scale", str(args.time_scale)]
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    rows = []
    arms = args.arms.split(",") + ([f"govern x{args.gateways}"] if args.gateways > 1 else [])
    with serving(cmd, lambda: get_ok(f"{emu}/admin/requests"), args.out / "emulator.log", env):
        for arm in arms:
            rows.append(run_arm(arm, emu, args.out, args))
            print(f"{arm}: done", flush=True)
    text = table(rows)
    print(text)
    (args.out / "control.json").write_text(
        json.dumps({"args": vars(args) | {"out": str(args.out)}, "arms": rows}, indent=2)
    )
    (args.out / "control.txt").write_text(text + "\n")
    gov = next((r for r in rows if r["arm"] == "govern"), None)
    others = [r for r in rows if not r["arm"].startswith("govern")]
    if gov is not None and others:
        cheapest = all(gov["cost_token_equivalents"] < r["cost_token_equivalents"] for r in others)
        print(
            f"governor cheaper than every other arm: {cheapest}; governor 429s: "
            f"{gov['rejected_429']}"
        )
        many = [r for r in rows if r["arm"].startswith("govern x")]
        for r in many:
            print(f"{r['arm']}: 429s {r['rejected_429']}, heartbeats {r['heartbeats']}")
        quiet = all(r["rejected_429"] <= gov["rejected_429"] for r in many)
        return 0 if cheapest and gov["rejected_429"] == 0 and quiet else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
