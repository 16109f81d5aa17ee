"""Run the load-test workloads headless against a gateway and write a report.

    .venv/bin/python -m loadtests.run [--host URL] [--small] [--duration S] [--users N]
        [--protocols http,grpc] [--compare-routing] [--compare-layout]

Starts a gateway with the demo model when none answers at --host (its one key
--api-key, by default the load tests' admin key: admin_key.py), runs each
workload with locust for at most --duration seconds (each ends early once
all its sessions were sent), and writes --out: per workload the workload
JSON, locust's CSV and HTML, the raw per-request CSV, two PNG plots (TTFT of
hits versus misses, hit rate over time), and one summary.json
with requests, errors, token-weighted hit rate (cross-checked with the
gateway's and the engines' Prometheus counters), TTFT p50/p90/p99, ITL
p50/p99 and requests/s.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from loadtests.admin_key import ADMIN_KEY, admin_env, bearer
from loadtests.plots import hit_rate_over_time, ttft_hits_vs_misses
from loadtests.procs import free_port, get_ok, run_locust, serving
from loadtests.report import counter_cross_check, parse_metrics, read_raw, summarize
from loadtests.workloads import (
    CountTokens,
    Workload,
    long_document_qa,
    multi_turn,
    shared_prefix,
    zero_reuse,
)

HERE = Path(__file__).resolve().parent

ALL = ("shared_prefix", "multi_turn", "long_document_qa", "zero_reuse")


def build(
    name: str,
    small: bool,
    seed: int,
    run_id: str,
    volatile: bool = False,
    count: CountTokens | None = None,
) -> Workload:
    """Sizes are in tokens of the served model when ``count`` is given (else in words:
    the provider path, whose emulator counts bytes)."""
    if name == "shared_prefix" and volatile:  # the provider path: past every minimum prefix
        if small:
            return shared_prefix(2, 800, 20, 4, 8, 1.0, seed, run_id, volatile=True)
        return shared_prefix(4, 1200, 40, 16, 60, 1.1, seed, run_id, volatile=True)
    if name == "shared_prefix":
        if small:
            return shared_prefix(2, 400, 20, 4, 8, 1.0, seed, run_id, count)
        return shared_prefix(8, 1200, 40, 16, 120, 1.1, seed, run_id, count)
    if name == "multi_turn":
        if small:
            return multi_turn(2, 3, 300, 30, 8, 0.0, seed, run_id, count)
        return multi_turn(8, 6, 500, 60, 32, 0.5, seed, run_id, count)
    if name == "long_document_qa":
        if small:
            return long_document_qa(2, 500, 3, 20, 4, True, seed, run_id, count)
        return long_document_qa(4, 1600, 8, 30, 16, False, seed, run_id, count)
    if name == "zero_reuse":
        n, p, o = (6, 400, 4) if small else (60, 1200, 16)
        return zero_reuse(n, p, o, seed, run_id, count)
    raise ValueError(f"unknown workload {name}")


def token_counter(tokenizer: str | None) -> CountTokens:
    """Prompt sizes in tokens of the served model (workloads are built before the run)."""
    from engines.tokenizer import ChatTokenizer

    if tokenizer is None:
        out = subprocess.run(
            [sys.executable, "-m", "gateway.cli", "demo-model"],
            capture_output=True,
            text=True,
            check=True,
        )
        tokenizer = out.stdout.strip().splitlines()[-1]
    tok = ChatTokenizer.from_pretrained(tokenizer)
    return lambda text: len(tok.encode(text))


def _ready(host: str) -> bool:
    return get_ok(f"{host}/readyz")


@contextmanager
def gateway(host: str, out: Path, args: argparse.Namespace) -> Iterator[None]:
    """Use the gateway at ``host``, or start one with the demo model there whose one key
    is ``--api-key`` (the load tests' admin key when none is given), an admin: the
    routing comparison's headers and ``/v1/cache/stats`` need one."""
    if _ready(host):
        yield
        return
    args.api_key = args.api_key or ADMIN_KEY
    port = host.rsplit(":", 1)[1]
    grpc_port = args.grpc_target.rsplit(":", 1)[1]
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--port", port]
    cmd += ["--grpc-port", grpc_port, "--replicas", str(args.replicas)]
    env = {**os.environ, **admin_env(args.api_key)}
    with serving(cmd, lambda: _ready(host), out / "gateway.log", env):
        yield


def metrics(host: str) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{host}/metrics", timeout=10).text)


def run_one(
    name: str,
    host: str,
    out: Path,
    args: argparse.Namespace,
    tag: str = "",
    extra_env: dict[str, str] | None = None,
    protocol: str = "http",
    volatile: bool = False,
    model: str | None = None,
) -> dict[str, object]:
    wdir = out / (f"{name}-{tag}" if tag else name)
    wdir.mkdir(parents=True, exist_ok=True)
    run_id = f"{args.run_id}-{tag}" if tag else args.run_id  # each arm starts cold
    if not volatile and args.count is None:
        args.count = token_counter(args.tokenizer)
    workload = build(
        name, args.small, args.seed, run_id, volatile, None if volatile else args.count
    )
    workload.dump(wdir / "workload.json")
    env = {"VCACHE_MODEL": model or args.model, "VCACHE_GRPC_TARGET": args.grpc_target}
    if args.api_key:
        env["VCACHE_API_KEY"] = args.api_key
    env.update(extra_env or {})
    user = "GrpcChatUser" if protocol == "grpc" else "ChatUser"
    before = metrics(host)
    elapsed = run_locust(
        wdir / "workload.json", host, wdir, env, args.users, args.duration, user, reports=True
    )
    after = metrics(host)
    raw = wdir / "raw.csv"
    rows = read_raw(raw) if raw.exists() else []
    summary = summarize(rows, elapsed)
    ttft_hits_vs_misses(rows, wdir.name, wdir / "ttft_hits_vs_misses.png")
    hit_rate_over_time(rows, wdir.name, wdir / "hit_rate_over_time.png")
    summary["workload"] = name
    summary["sessions"] = len(workload.sessions)
    summary["run_id"] = run_id
    summary["elapsed_s"] = round(elapsed, 2)
    summary["counters"] = counter_cross_check(before, after)
    summary["protocol"] = protocol
    return summary


def table(results: dict[str, dict[str, object]], title: str, row: str = "workload") -> str:
    """One result per row, under a title that says what was run; ``row`` names the first
    column (a workload, or the arm of a comparison), and every row names its workload."""
    head = (
        f"{row:<22}{'workload':<18}{'proto':<6}{'req':>5}{'err':>5}{'hit':>8}"
        f"{'ttft p50':>10}{'p90':>9}{'p99':>9}{'req/s':>8}"
    )
    lines = [title, head]
    for name, s in results.items():
        ttft = s["ttft_ms"]
        assert isinstance(ttft, dict)

        def ms(v: object) -> str:
            return "-" if v is None else f"{float(v):.0f}"  # type: ignore[arg-type]

        lines.append(
            f"{name:<22}{s.get('workload', name)!s:<18}{s.get('protocol', 'http')!s:<6}"
            f"{s['requests']:>5}{s['errors']:>5}{float(s['hit_rate']):>8.3f}"  # type: ignore[arg-type]
            f"{ms(ttft['p50']):>10}{ms(ttft['p90']):>9}{ms(ttft['p99']):>9}"
            f"{float(s['requests_per_s']):>8.2f}"  # type: ignore[arg-type]
        )
    return "\n".join(lines)


ARMS = ("kv", "round_robin", "least_loaded", "oracle")


def replica_count(host: str, api_key: str | None) -> int:
    """The gateway's local replicas (``/v1/cache/stats``: an admin's)."""
    headers = bearer(api_key) if api_key else {}
    r = httpx.get(f"{host}/v1/cache/stats", headers=headers, timeout=30)
    if r.status_code in (401, 403):
        raise SystemExit(f"--compare-routing needs an admin --api-key for {host}: {r.text}")
    return len(r.json()["replicas"]) if r.status_code == 200 else 1


def compare_routing(host: str, out: Path, args: argparse.Namespace) -> dict[str, object]:
    """The shared-prefix workload under each policy, and an oracle that pins each group."""
    n = replica_count(host, args.api_key)
    arms: dict[str, dict[str, object]] = {}
    for arm in ARMS:
        env = {"VCACHE_ORACLE_REPLICAS": str(n)} if arm == "oracle" else {"VCACHE_ROUTING": arm}
        arms[arm] = run_one("shared_prefix", host, out, args, tag=arm, extra_env=env)
    base = arms["round_robin"]

    def ratio(arm: dict[str, object], key: str) -> float | None:
        a, b = arm["ttft_ms"], base["ttft_ms"]
        assert isinstance(a, dict) and isinstance(b, dict)
        return a[key] / b[key] if a.get(key) and b.get(key) else None

    return {
        "replicas": n,
        "arms": arms,
        "vs_round_robin": {
            name: {
                "hit_rate": arm["hit_rate"],
                "hit_rate_ratio": (
                    float(arm["hit_rate"]) / float(base["hit_rate"])  # type: ignore[arg-type]
                    if base["hit_rate"]
                    else None
                ),
                "ttft_p50_ratio": ratio(arm, "p50"),
                "ttft_p90_ratio": ratio(arm, "p90"),
            }
            for name, arm in arms.items()
        },
    }


LAYOUTS = ("canonical", "passthrough")


def compare_layout(out: Path, args: argparse.Namespace) -> dict[str, object]:
    """The provider path through the emulator: shared_prefix with a timestamp line in every
    system prompt, under ``prompt_layout: canonical`` and ``passthrough``, per provider model.

    Starts the emulator and, per layout, a provider-only gateway (no local engine)."""
    emu_port, results = free_port(), {}
    emu = f"http://127.0.0.1:{emu_port}"
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    base = {"anthropic": f"{emu}/v1", "openai": f"{emu}/v1", "gemini": f"{emu}/v1beta"}
    base["deepseek"] = f"{emu}/deepseek"
    emulator = [sys.executable, "-m", "loadtests.emulator", "--port", str(emu_port)]
    with serving(emulator, lambda: get_ok(f"{emu}/admin/requests"), out / "emulator.log", env):
        for layout in LAYOUTS:
            port = free_port()
            host = f"http://127.0.0.1:{port}"
            genv = {
                **env,
                "VCACHE_ENGINE__REPLICAS": "0",
                "VCACHE_PROMPT_LAYOUT": layout,
                "VCACHE_PROVIDERS": json.dumps(
                    {p: {"base_url": u, "api_key": "loadtest"} for p, u in base.items()}
                ),
            }
            cmd = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port)]
            cmd += ["--grpc-port", str(free_port())]
            ready = functools.partial(_ready, host)
            with serving(cmd, ready, out / f"gateway-{layout}.log", genv):
                for model in args.layout_models.split(","):
                    tag = f"{model.split('/')[0]}-{layout}"
                    results[tag] = run_one(
                        "shared_prefix", host, out, args, tag=tag, volatile=True, model=model
                    )
    ratios = {}
    for model in args.layout_models.split(","):
        p = model.split("/")[0]
        on, off = results[f"{p}-canonical"], results[f"{p}-passthrough"]
        hit_on, hit_off = float(on["hit_rate"]), float(off["hit_rate"])  # type: ignore[arg-type]
        ratios[model] = {
            "hit_rate_canonical": hit_on,
            "hit_rate_passthrough": hit_off,
            "hit_rate_ratio": hit_on / hit_off if hit_off else None,
        }
    return {"arms": results, "ratios": ratios}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--host", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="vcache-demo")
    ap.add_argument("--api-key", default=os.environ.get("VCACHE_LOADTEST_KEY"))
    ap.add_argument("--workloads", default=",".join(ALL))
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--duration", type=int, default=120, help="upper bound per workload (s)")
    ap.add_argument("--small", action="store_true", help="small sizes (smoke runs)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument(
        "--compare-routing",
        action="store_true",
        help="also run shared_prefix under kv, round_robin, least_loaded and an oracle "
        "(admin headers: a gateway already at --host needs an admin --api-key)",
    )
    ap.add_argument(
        "--compare-layout",
        action="store_true",
        help="also run the provider path through the emulator with prompt_layout canonical "
        "and passthrough (starts the emulator and provider-only gateways)",
    )
    ap.add_argument("--layout-models", default="anthropic/claude-sonnet-4-5,openai/gpt-5")
    ap.add_argument("--protocols", default="http", help="http, grpc or both (comma-separated)")
    ap.add_argument("--grpc-target", default="127.0.0.1:50051")
    ap.add_argument("--replicas", type=int, default=1, help="replicas of a gateway started here")
    ap.add_argument(
        "--tokenizer",
        default=None,
        help="the served model's tokenizer (a path or hub id) to size prompts in its tokens "
        "(default: the demo model's, built if needed)",
    )
    ap.add_argument("--run-id", default=f"{time.time_ns():x}", help="opens every prompt")
    ap.add_argument(
        "--out", type=Path, default=Path("reports") / time.strftime("loadtest-%Y%m%d-%H%M%S")
    )
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.count = None  # the served model's token counter, loaded when a local workload runs
    results: dict[str, dict[str, object]] = {}
    t0 = time.monotonic()
    protocols = args.protocols.split(",")
    with gateway(args.host, args.out, args):
        for name in (w for w in args.workloads.split(",") if w):
            for protocol in protocols:
                key = name if protocol == "http" else f"{name}-{protocol}"
                tag = "" if protocol == "http" else protocol
                results[key] = run_one(name, args.host, args.out, args, tag, protocol=protocol)
        comparison = compare_routing(args.host, args.out, args) if args.compare_routing else None
    layout = compare_layout(args.out, args) if args.compare_layout else None
    (args.out / "summary.json").write_text(json.dumps(results, indent=2))
    tables = [table(results, f"workloads on {args.host} ({args.users} users)")]
    if comparison is not None:
        (args.out / "routing.json").write_text(json.dumps(comparison, indent=2))
        arms = comparison["arms"]
        assert isinstance(arms, dict)
        title = f"routing comparison: shared_prefix on {comparison['replicas']} replicas, per arm"
        tables.append(table(arms, title, row="arm"))
    if layout is not None:
        (args.out / "layout.json").write_text(json.dumps(layout, indent=2))
        arms = layout["arms"]
        assert isinstance(arms, dict)
        title = "provider path through the emulator: prompt_layout canonical vs passthrough"
        tables.append(table(arms, title, row="provider-layout"))
    print("\n\n".join(tables))
    (args.out / "tables.txt").write_text("\n\n".join(tables) + "\n")
    if layout is not None:
        for model, r in layout["ratios"].items():  # type: ignore[attr-defined]
            ratio = r["hit_rate_ratio"]
            print(
                f"  {model}: hit rate {r['hit_rate_canonical']:.3f} canonical, "
                f"{r['hit_rate_passthrough']:.3f} passthrough, ratio "
                + ("inf" if ratio is None else f"{ratio:.2f}")
            )
    print(f"total {time.monotonic() - t0:.0f} s; report: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
