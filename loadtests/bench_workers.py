"""The gateway's frontend over processes: ``--workers 1`` against ``--workers 2``, and
the frontend ceiling beside vLLM's own server's, in one run.

    .venv/bin/python -m loadtests.bench_workers            # both parts
    .venv/bin/python -m loadtests.bench_workers --part workers

``workers``: one upstream that is never the bottleneck (the provider emulator,
its OpenAI route), ``vcache serve`` in front of it provider-only with the
session log on (as deployed), once with one worker and once with two, taking
turns slice by slice at ``--concurrency`` clients.  Per arm: requests/s,
gateway CPU ms per request (the parent and every worker, from ``/proc``
through psutil), p50/p90 latency, and how the requests spread over the
workers (each worker's share of the gateway CPU).

``embedded``: one embedded replica (the demo model on the CPU engine) behind
``--workers 1`` and ``--workers 2`` (one engine core in the parent, each worker
its client), the same requests in turns: the frontend's CPU per request (the
gateway processes, not the engine core's) and how it spreads over the workers.
The engine is the bottleneck here; the part shows what a second frontend costs.

``placement``: two embedded replicas behind one gateway, each on its own CPU
cores (``engine.placement: auto``, the default) and as vLLM alone would place
them (``none``), the same requests in turns: requests/s and latency with both
replicas busy.

``frontend``: vLLM's own OpenAI server on the demo model (CPU engine) and
``vcache serve`` in front of the same server as a remote replica (two gateways:
one sending token ids to its generate route, one to its completions route),
the same requests in turns.  Behind a gateway, the replica's API server's own
CPU per request is reported too.  Per frontend: CPU ms per request and µs per output token of
the frontend process alone (vLLM's API server without its engine-core child;
the gateway process), and the ceiling that implies for one core:
requests/s = 1000 / CPU ms, output tokens/s = 1e6 / CPU µs per token.

Prints a table and writes JSON (``--out``).  On a 2-core machine the load
generator and the upstream share the cores with the gateway: the rise from a
second worker is bounded by what they leave.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from loadtests.procs import free_port, get_ok, serving
from loadtests.report import percentile

HERE = Path(__file__).resolve().parent

SYSTEM = "You answer questions about the vcache manual, one section at a time.\n" * 20


def _cpu(p: psutil.Process) -> float:
    try:
        t = p.cpu_times()
        return float(t.user + t.system)
    except psutil.NoSuchProcess:
        return 0.0


def _engine(p: psutil.Process) -> bool:
    """A vLLM engine process (``VLLM::EngineCore``, ``VLLM::Worker``), or its helper."""
    try:
        return p.name().startswith("VLLM") or "resource_tracker" in " ".join(p.cmdline())
    except psutil.NoSuchProcess:
        return True


def cpu_by_process(pid: int, children: bool) -> dict[int, float]:
    """CPU seconds of ``pid`` and, with ``children``, of each of its descendants that is
    not an engine process (the frontend alone)."""
    p = psutil.Process(pid)
    out = {pid: _cpu(p)}
    if children:
        for c in p.children():
            if not _engine(c):
                out[c.pid] = _cpu(c)
    return out


def body(i: int, model: str, words: int) -> dict[str, Any]:
    return {
        "model": model,
        "max_tokens": words,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"question {i}: what does section {i % 50} say?"},
        ],
    }


class Arm:
    def __init__(
        self, url: str, model: str, pid: int, children: bool, upstream: int | None = None
    ) -> None:
        self.url, self.model, self.pid, self.children = url, model, pid, children
        self.upstream = upstream  # a process behind this one whose CPU is counted apart
        self.latencies: list[float] = []
        self.wall = 0.0
        self.cpu: dict[int, float] = {}
        self.upstream_cpu = 0.0
        self.tokens = 0

    def row(self) -> dict[str, Any]:
        n = len(self.latencies)
        cpu = sum(self.cpu.values())
        xs = [x * 1e3 for x in self.latencies]
        shares = sorted((v / cpu for pid, v in self.cpu.items() if pid != self.pid), reverse=True)
        return {
            "requests": n,
            "requests_per_s": n / self.wall if self.wall else 0.0,
            "cpu_ms_per_request": cpu / n * 1e3 if n else 0.0,
            "cpu_us_per_output_token": cpu / self.tokens * 1e6 if self.tokens else None,
            "latency_p50_ms": percentile(xs, 50),
            "latency_p90_ms": percentile(xs, 90),
            "worker_cpu_shares": [round(s, 3) for s in shares] if self.children else None,
            "upstream_cpu_ms_per_request": (
                self.upstream_cpu / n * 1e3 if n and self.upstream is not None else None
            ),
        }


async def _slice(
    arm: Arm, start: int, size: int, concurrency: int, words: int, fresh: bool = False
) -> None:
    """``size`` requests from ``concurrency`` clients, on kept-alive connections (one per
    client: the kernel spreads connections, not requests, over the workers) or, with
    ``fresh``, a new connection per request."""
    todo = iter(range(start, start + size))
    limit = aiohttp.TCPConnector(limit=concurrency, force_close=fresh)
    async with aiohttp.ClientSession(connector=limit) as session:

        async def client() -> None:
            for i in todo:
                t0 = time.perf_counter()
                async with session.post(arm.url, json=body(i, arm.model, words)) as r:
                    data = await r.json()
                    if r.status != 200:
                        raise SystemExit(f"{arm.url}: HTTP {r.status}: {str(data)[:300]}")
                arm.latencies.append(time.perf_counter() - t0)
                arm.tokens += int(data["usage"]["completion_tokens"])

        up = psutil.Process(arm.upstream) if arm.upstream is not None else None
        before = cpu_by_process(arm.pid, arm.children)
        up_before = _cpu(up) if up is not None else 0.0
        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        arm.wall += time.perf_counter() - t0
        after = cpu_by_process(arm.pid, arm.children)
        arm.upstream_cpu += _cpu(up) - up_before if up is not None else 0.0
        for pid, v in after.items():
            arm.cpu[pid] = arm.cpu.get(pid, 0.0) + v - before.get(pid, 0.0)


def turns(arms: dict[str, Arm], args: argparse.Namespace, words: int) -> None:
    n = 0
    for arm in arms.values():  # warm-up, not counted
        asyncio.run(_slice(arm, n, 40, 4, words))
        arm.latencies, arm.wall, arm.cpu, arm.tokens, arm.upstream_cpu = [], 0.0, {}, 0, 0.0
        n += 40
    for _ in range(args.rounds):
        for arm in arms.values():
            asyncio.run(_slice(arm, n, args.slice, args.concurrency, words, args.new_connections))
            n += args.slice


def _gateway(port: int, workers: int, extra: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), "--replicas", "0"]
    return [*cmd, "--grpc-port", str(free_port()), "--workers", str(workers), *extra]


def part_workers(args: argparse.Namespace, work: Path, env: dict[str, str]) -> dict[str, Any]:
    emu_port = free_port()
    emu = f"http://127.0.0.1:{emu_port}"
    emulator = [sys.executable, "-m", "loadtests.emulator", "--port", str(emu_port)]
    providers = {"openai": {"base_url": f"{emu}/v1", "api_key": "k"}}
    vc_env = {**env, "VCACHE_LOG_LEVEL": "warning", "VCACHE_PROVIDERS": json.dumps(providers)}
    if args.per_connection is not None:
        vc_env["VCACHE_HTTP__MAX_REQUESTS_PER_CONNECTION"] = str(args.per_connection)
    arms: dict[str, Arm] = {}
    with contextlib.ExitStack() as stack:
        stack.enter_context(
            serving(emulator, partial(get_ok, f"{emu}/admin/requests"), work / "emu.log", env)
        )
        for n in (1, 2):
            port = free_port()
            own = {**vc_env, "VCACHE_DATA_DIR": str(work / f"w{n}")}
            ready = partial(get_ok, f"http://127.0.0.1:{port}/readyz")
            proc = stack.enter_context(
                serving(_gateway(port, n, []), ready, work / f"w{n}.log", own)
            )
            if n > 1:  # every worker up, not just the first to answer
                while len(psutil.Process(proc.pid).children()) < n:
                    time.sleep(0.2)
                time.sleep(3)
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            arms[f"vcache --workers {n}"] = Arm(url, "openai/gpt-5", proc.pid, children=True)
        turns(arms, args, words=8)
    return {name: arm.row() for name, arm in arms.items()}


def part_embedded(args: argparse.Namespace, work: Path, env: dict[str, str]) -> dict[str, Any]:
    """One embedded replica (the demo model, CPU engine) behind one worker and behind two
    (one engine core, each worker its client): the frontend's CPU per request."""
    from engines.vllm.demo_model import ensure_demo_model

    ensure_demo_model(Path(args.data_dir))
    g_env = {**env, "VCACHE_LOG_LEVEL": "warning"}
    arms: dict[str, Arm] = {}
    with contextlib.ExitStack() as stack:
        for n in (1, 2):
            port = free_port()
            own = {**g_env, "VCACHE_SESSION_LOG__PATH": str(work / f"e{n}.db")}
            cmd = _gateway(
                port,
                n,
                [
                    "--data-dir",
                    args.data_dir,
                    "--kv-cache-bytes",
                    str(64 << 20),
                    "--max-model-len",
                    "2048",
                    "--enforce-eager",
                ],
            )
            cmd[cmd.index("--replicas") + 1] = "1"
            ready = partial(get_ok, f"http://127.0.0.1:{port}/readyz")
            proc = stack.enter_context(serving(cmd, ready, work / f"e{n}.log", own))
            if n > 1:
                while len([c for c in psutil.Process(proc.pid).children() if not _engine(c)]) < n:
                    time.sleep(0.2)
                time.sleep(5)
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            arms[f"embedded --workers {n}"] = Arm(url, "vcache-demo", proc.pid, children=True)
        turns(arms, args, words=args.words)
    return {name: arm.row() for name, arm in arms.items()}


def part_placement(args: argparse.Namespace, work: Path, env: dict[str, str]) -> dict[str, Any]:
    """Two embedded replicas, each on its own cores (``engine.placement: auto``) and as
    vLLM alone places them (``none``: on CPU, every engine's threads on the first core),
    the same requests in turns: what both replicas busy at once serve."""
    from engines.vllm.demo_model import ensure_demo_model

    ensure_demo_model(Path(args.data_dir))
    arms: dict[str, Arm] = {}
    with contextlib.ExitStack() as stack:
        for placement in ("none", "auto"):
            port = free_port()
            own = {
                **env,
                "VCACHE_LOG_LEVEL": "warning",
                "VCACHE_ENGINE__PLACEMENT": placement,
                "VCACHE_SESSION_LOG__PATH": str(work / f"p-{placement}.db"),
            }
            cmd = _gateway(
                port,
                1,
                [
                    "--data-dir",
                    args.data_dir,
                    "--kv-cache-bytes",
                    str(64 << 20),
                    "--max-model-len",
                    "2048",
                    "--enforce-eager",
                ],
            )
            cmd[cmd.index("--replicas") + 1] = "2"
            ready = partial(get_ok, f"http://127.0.0.1:{port}/readyz")
            proc = stack.enter_context(serving(cmd, ready, work / f"p-{placement}.log", own))
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            arms[f"2 replicas, placement {placement}"] = Arm(url, "vcache-demo", proc.pid, False)
        turns(arms, args, words=args.words)
    return {name: arm.row() for name, arm in arms.items()}


def part_frontend(args: argparse.Namespace, work: Path, env: dict[str, str]) -> dict[str, Any]:
    from engines.vllm.demo_model import ensure_demo_model

    model = ensure_demo_model(Path(args.data_dir))
    vport, gport = free_port(), free_port()
    events = f"ipc://{work}/events"
    kv = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events}
    vllm = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        "vcache-demo",
        "--port",
        str(vport),
        "--enable-prefix-caching",
        "--prefix-caching-hash-algo",
        "sha256_cbor",
        "--enable-prompt-tokens-details",
        "--kv-events-config",
        json.dumps(kv),
        "--kv-cache-memory-bytes",
        str(64 << 20),
        "--max-model-len",
        "2048",
        "--enforce-eager",
        "--enable-scale-out",
    ]
    v_env = {
        **env,
        "PYTHONHASHSEED": "0",
        "VLLM_PLUGINS": "vcache,vcache-control",
        "VCACHE_CONTROL_SECRET": "bench",
    }
    replica = {"url": f"http://127.0.0.1:{vport}", "kv_events": events, "control_secret": "bench"}
    arms: dict[str, Arm] = {}
    with contextlib.ExitStack() as stack:
        vready = partial(get_ok, f"http://127.0.0.1:{vport}/v1/models")
        vproc = stack.enter_context(serving(vllm, vready, work / "vllm.log", v_env))
        arms["vllm api server"] = Arm(
            f"http://127.0.0.1:{vport}/v1/chat/completions", "vcache-demo", vproc.pid, False
        )
        for api in ("generate", "completions"):  # the replica's route for token ids
            gport = free_port()
            g_env = {
                **env,
                "VCACHE_LOG_LEVEL": "warning",
                "VCACHE_DATA_DIR": str(work / api),
                "VCACHE_REMOTE_REPLICAS": json.dumps([replica | {"api": api}]),
            }
            gready = partial(get_ok, f"http://127.0.0.1:{gport}/readyz")
            gproc = stack.enter_context(
                serving(_gateway(gport, 1, []), gready, work / f"{api}.log", g_env)
            )
            arms[f"vcache -> {api}"] = Arm(
                f"http://127.0.0.1:{gport}/v1/chat/completions",
                "vcache-demo",
                gproc.pid,
                False,
                upstream=vproc.pid,
            )
        turns(arms, args, words=args.words)
    out = {}
    for name, arm in arms.items():
        r = arm.row()
        r["ceiling_requests_per_s_per_core"] = 1000 / r["cpu_ms_per_request"]
        per_token = r["cpu_us_per_output_token"]
        r["ceiling_output_tokens_per_s_per_core"] = 1e6 / per_token if per_token else None
        out[name] = r
    return out


def table(out: dict[str, Any]) -> str:
    lines = [
        f"{'part':<10}{'arm':<26}{'req/s':>7}{'CPU ms/req':>11}{'p50 ms':>8}{'p90 ms':>8}  extra"
    ]
    for part, arms in out["parts"].items():
        for name, r in arms.items():
            extra = ""
            if r.get("worker_cpu_shares"):
                extra = f"worker CPU shares {r['worker_cpu_shares']}"
            if "ceiling_requests_per_s_per_core" in r:
                extra = (
                    f"{r['cpu_us_per_output_token']:.0f} us/token; ceiling per core "
                    f"{r['ceiling_requests_per_s_per_core']:.0f} req/s, "
                    f"{r['ceiling_output_tokens_per_s_per_core']:.0f} tok/s"
                )
            if r.get("upstream_cpu_ms_per_request") is not None:
                extra += f"; replica frontend {r['upstream_cpu_ms_per_request']:.2f} ms/req"
            lines.append(
                f"{part:<10}{name:<26}{r['requests_per_s']:>7.0f}{r['cpu_ms_per_request']:>11.2f}"
                f"{r['latency_p50_ms']:>8.1f}{r['latency_p90_ms']:>8.1f}  {extra}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parts = ("workers", "embedded", "placement", "frontend", "both")
    ap.add_argument("--part", choices=parts, default="both")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--slice", type=int, default=600, help="requests per arm per turn")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--words", type=int, default=32, help="output tokens, frontend part")
    ap.add_argument("--new-connections", action="store_true", help="one per request")
    ap.add_argument(
        "--per-connection",
        type=int,
        default=None,
        help="the gateway's http.max_requests_per_connection (default: its own)",
    )
    ap.add_argument("--data-dir", default=str(HERE.parent / ".vcache-test-data"))
    ap.add_argument("--out", type=Path, default=Path("reports/bench_workers.json"))
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-workers-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("VCACHE_")}
    env["PYTHONPATH"] = str(HERE.parent)
    out: dict[str, Any] = {
        "concurrency": args.concurrency,
        "slice": args.slice,
        "rounds": args.rounds,
        "cpus": os.cpu_count(),
        "new_connections": args.new_connections,
        "per_connection": args.per_connection,
        "parts": {},
    }
    if args.part in ("workers", "both"):
        out["parts"]["workers"] = part_workers(args, work, env)
    if args.part == "embedded":
        out["parts"]["embedded"] = part_embedded(args, work, env)
    if args.part == "placement":
        out["parts"]["placement"] = part_placement(args, work, env)
    if args.part in ("frontend", "both"):
        out["parts"]["frontend"] = part_frontend(args, work, env)
    print(table(out))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
