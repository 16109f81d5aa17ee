"""The provider path's own cost against LiteLLM proxy's, interleaved in one run.

    .venv/bin/python -m loadtests.bench_proxy --litellm /path/to/venv/bin/litellm

One fixed upstream (the emulator's OpenAI route), two proxies in front of it:
``vcache serve`` (provider-only, the session log on, as deployed) and
LiteLLM's proxy (installed in a venv of its own; see the README for the
packages).  Each proxy's CPU time (user + system, its process and children,
from ``/proc`` through psutil) is read around what it serves.  Four phases,
each interleaved between the proxies so that both meet the same machine:

- ``one at a time``: one client sends the same non-streamed chat request (a
  ~1k-token system prompt and a question) to each in turn, A B A B, with the
  upstream alone as a third column for reference.  Every request finds its
  proxy idle since the last one, so this includes what a process pays to come
  back from idle (caches, a vCPU given back to the host; measured in
  ``docs/proxy_cpu.md``).
- ``under load``: ``--concurrency`` clients keep each proxy busy for a slice
  of ``--slice`` requests, the proxies taking turns slice by slice for
  ``--rounds`` rounds: what a request costs a gateway that is serving.
- ``under load, streamed``: the same with ``stream: true`` (every SSE event
  read to the end).
- ``streamed, N words``: the same streamed, with answers of ``--long-words``
  words (one event each; the emulator's ``--answer-words``), in slices of
  ``--long-slice``: what each streamed token costs, printed per event too.

``--baseline PATH`` adds a third proxy, ``vcache@base``: ``vcache serve``
from another checkout (its gRPC stubs generated), the same settings, taking
its turns like the others: a before/after on the same machine in the same run.

Prints per phase and proxy: CPU ms per request, median and p90 latency and
requests/s; writes JSON; exits 1 when vcache's CPU per non-streamed request
under load is above ``--target-ms`` (1.5).
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
import httpx
import psutil

from loadtests.procs import free_port, get_ok, serving
from loadtests.report import percentile

HERE = Path(__file__).resolve().parent

SYSTEM = "You answer questions about the vcache manual, one section at a time.\n" * 60
PHASES = ("one at a time", "under load", "under load, streamed")
SHORT_WORDS = 8  # max_tokens of every phase but the long one


def cpu_s(pid: int) -> float:
    p = psutil.Process(pid)
    total: float = sum(p.cpu_times()[:2])
    for c in p.children(recursive=True):
        try:
            total += sum(c.cpu_times()[:2])
        except psutil.NoSuchProcess:
            continue
    return total


def body(
    i: int, model: str = "gpt-5", stream: bool = False, words: int = SHORT_WORDS
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": model,
        "max_tokens": words,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"question {i}: what does section {i % 50} say?"},
        ],
    }
    if stream:
        out["stream"] = True
    return out


class Tally:
    """CPU seconds, latencies and busy seconds of one proxy in one phase."""

    def __init__(self) -> None:
        self.cpu = 0.0
        self.wall = 0.0
        self.latencies: list[float] = []

    def row(self, measured_cpu: bool) -> dict[str, Any]:
        xs = [x * 1e3 for x in self.latencies]
        row: dict[str, Any] = {
            "requests": len(xs),
            "latency_p50_ms": percentile(xs, 50),
            "latency_p90_ms": percentile(xs, 90),
            "requests_per_s": len(xs) / self.wall if self.wall else None,
        }
        if measured_cpu:
            row["cpu_ms_per_request"] = self.cpu / len(xs) * 1e3
        return row


def one_at_a_time(
    targets: dict[str, tuple[str, str]], pids: dict[str, int], warmup: int, requests: int
) -> dict[str, Tally]:
    """A B U A B U …: one request to each in turn from one client."""
    tallies = {name: Tally() for name in targets}
    with httpx.Client(timeout=30) as client:

        def send(name: str, i: int) -> float:
            url, model = targets[name]
            t0 = time.perf_counter()
            r = client.post(url, json=body(i, model), headers={"authorization": "Bearer sk-bench"})
            took = time.perf_counter() - t0
            if r.status_code != 200:
                raise SystemExit(f"{name}: HTTP {r.status_code}: {r.text[:300]}")
            return took

        for i in range(warmup):
            for name in targets:
                send(name, i)
        before = {n: cpu_s(p) for n, p in pids.items()}
        for i in range(requests):
            for name in targets:
                tallies[name].latencies.append(send(name, warmup + i))
        after = {n: cpu_s(p) for n, p in pids.items()}
    for name, t in tallies.items():  # no requests/s: one client paced all three
        t.cpu = after[name] - before[name] if name in pids else 0.0
    return tallies


async def _slice(
    session: aiohttp.ClientSession, url: str, bodies: list[dict[str, Any]], concurrency: int
) -> list[float]:
    """Send ``bodies`` from ``concurrency`` clients; each answer read to its last byte."""
    todo = iter(bodies)
    latencies: list[float] = []

    async def client() -> None:
        for b in todo:
            t0 = time.perf_counter()
            async with session.post(url, json=b) as r:
                data = await r.read()
                if r.status != 200:
                    raise SystemExit(f"{url}: HTTP {r.status}: {data[:300]!r}")
            latencies.append(time.perf_counter() - t0)

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return latencies


async def under_load(
    targets: dict[str, tuple[str, str]],
    pids: dict[str, int],
    args: argparse.Namespace,
    stream: bool,
    words: int = SHORT_WORDS,
    size: int | None = None,
) -> dict[str, Tally]:
    """Slices of ``size`` (``args.slice``) requests at ``args.concurrency``, the proxies in
    turn; answers of ``words`` words."""
    size = size or args.slice
    tallies = {name: Tally() for name in pids}
    headers = {"authorization": "Bearer sk-bench"}
    limit = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(headers=headers, connector=limit) as session:
        n = 0
        for name in pids:  # warm-up
            url, model = targets[name]
            await _slice(session, url, [body(i, model, stream, words) for i in range(50)], 4)
        for _ in range(args.rounds):
            for name, pid in pids.items():
                url, model = targets[name]
                bodies = [body(n + i, model, stream, words) for i in range(size)]
                n += size
                cpu0, t0 = cpu_s(pid), time.perf_counter()
                tallies[name].latencies += await _slice(session, url, bodies, args.concurrency)
                tallies[name].wall += time.perf_counter() - t0
                tallies[name].cpu += cpu_s(pid) - cpu0
    return tallies


def run(args: argparse.Namespace) -> dict[str, Any]:
    emu_port, ll_port = free_port(), free_port()
    emu = f"http://127.0.0.1:{emu_port}"
    work = Path(tempfile.mkdtemp(prefix="bench-proxy-"))
    env = {**os.environ, "PYTHONPATH": str(HERE.parent), "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    vc_env = {
        **env,
        "VCACHE_ENGINE__REPLICAS": "0",
        "VCACHE_PROVIDERS": json.dumps({"openai": {"base_url": f"{emu}/v1", "api_key": "k"}}),
        "VCACHE_LOG_LEVEL": "warning",
    }
    cfg = work / "litellm.yaml"
    cfg.write_text(
        "model_list:\n"
        "  - model_name: gpt-5\n"
        "    litellm_params:\n"
        f"      model: openai/gpt-5\n      api_base: {emu}/v1\n      api_key: k\n"
        "general_settings:\n  master_key: sk-bench\n"
    )
    emulator = [sys.executable, "-m", "loadtests.emulator", "--port", str(emu_port)]
    emulator += ["--answer-words", str(max(args.long_words, SHORT_WORDS))]
    litellm = [args.litellm, "--config", str(cfg), "--port", str(ll_port), "--num_workers", "1"]
    ll_ready = f"http://127.0.0.1:{ll_port}/health/liveliness"
    builds = {"vcache": HERE.parent}
    if args.baseline is not None:
        builds["vcache@base"] = args.baseline.resolve()
    targets: dict[str, tuple[str, str]] = {}
    with contextlib.ExitStack() as stack:
        stack.enter_context(
            serving(emulator, lambda: get_ok(f"{emu}/admin/requests"), work / "emu.log", env)
        )
        pids: dict[str, int] = {}
        for name, repo in builds.items():
            port = free_port()
            cmd = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port)]
            cmd += ["--grpc-port", str(free_port())]
            own = {**vc_env, "PYTHONPATH": str(repo), "VCACHE_DATA_DIR": str(work / name)}
            ready = f"http://127.0.0.1:{port}/readyz"
            proc = stack.enter_context(
                serving(cmd, partial(get_ok, ready), work / f"{name}.log", own, cwd=repo)
            )
            pids[name] = proc.pid
            targets[name] = (f"http://127.0.0.1:{port}/v1/chat/completions", "openai/gpt-5")
        ll = stack.enter_context(serving(litellm, lambda: get_ok(ll_ready), work / "ll.log", env))
        pids["litellm"] = ll.pid
        targets["litellm"] = (f"http://127.0.0.1:{ll_port}/v1/chat/completions", "gpt-5")
        targets["upstream"] = (f"{emu}/v1/chat/completions", "gpt-5")
        phases = {
            PHASES[0]: one_at_a_time(targets, pids, args.warmup, args.requests),
            PHASES[1]: asyncio.run(under_load(targets, pids, args, stream=False)),
            PHASES[2]: asyncio.run(under_load(targets, pids, args, stream=True)),
        }
        if args.long_words:
            long = under_load(targets, pids, args, True, args.long_words, args.long_slice)
            phases[f"streamed, {args.long_words} words"] = asyncio.run(long)
    out: dict[str, Any] = {
        "requests_one_at_a_time": args.requests,
        "concurrency": args.concurrency,
        "rounds": args.rounds,
        "slice": args.slice,
        "long_words": args.long_words,
        "long_slice": args.long_slice,
        "phases": {},
    }
    for phase, tallies in phases.items():
        rows = {name: t.row(name in pids) for name, t in tallies.items()}
        if phase.endswith(" words"):
            for r in rows.values():
                r["cpu_us_per_event"] = r["cpu_ms_per_request"] / args.long_words * 1e3
        vc_cpu = rows["vcache"]["cpu_ms_per_request"]
        ratio = rows["litellm"]["cpu_ms_per_request"] / max(vc_cpu, 1e-9)
        out["phases"][phase] = {"proxies": rows, "cpu_ratio_litellm_over_vcache": ratio}
        if "vcache@base" in rows:
            base = rows["vcache@base"]["cpu_ms_per_request"] / max(vc_cpu, 1e-9)
            out["phases"][phase]["cpu_ratio_base_over_vcache"] = base
    return out


def table(out: dict[str, Any]) -> str:
    lines = [f"{'phase':<24}{'proxy':<10}{'CPU ms/req':>11}{'p50 ms':>9}{'p90 ms':>9}{'req/s':>8}"]
    for phase, p in out["phases"].items():
        for name, r in p["proxies"].items():
            cpu = r.get("cpu_ms_per_request")
            rps = r["requests_per_s"]
            lines.append(
                f"{phase:<24}{name:<10}{'-' if cpu is None else f'{cpu:.2f}':>11}"
                f"{r['latency_p50_ms']:>9.2f}{r['latency_p90_ms']:>9.2f}"
                f"{'-' if rps is None else f'{rps:.0f}':>8}"
            )
        ratios = f"LiteLLM / vcache CPU: {p['cpu_ratio_litellm_over_vcache']:.2f}x"
        if "cpu_us_per_event" in p["proxies"]["vcache"]:
            per = ", ".join(
                f"{n} {r['cpu_us_per_event']:.0f}"
                for n, r in p["proxies"].items()
                if "cpu_us_per_event" in r
            )
            ratios += f"; CPU us per event: {per}"
        if "cpu_ratio_base_over_vcache" in p:
            ratios += f"; vcache@base / vcache: {p['cpu_ratio_base_over_vcache']:.2f}x"
        lines.append(f"{'':<24}{ratios}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--litellm", required=True, help="the litellm executable (its own venv)")
    ap.add_argument("--requests", type=int, default=600, help="one at a time, per proxy")
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--concurrency", type=int, default=8, help="clients under load")
    ap.add_argument("--slice", type=int, default=400, help="requests per proxy per turn")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--long-words", type=int, default=200, help="a long answer (0: skip)")
    ap.add_argument("--long-slice", type=int, default=50, help="long requests per turn")
    ap.add_argument("--target-ms", type=float, default=1.5)
    ap.add_argument("--baseline", type=Path, help="another vcache checkout, run beside")
    ap.add_argument("--out", type=Path, default=Path("reports/bench_proxy.json"))
    args = ap.parse_args(argv)
    out = run(args)
    print(table(out))
    vc = out["phases"][PHASES[1]]["proxies"]["vcache"]["cpu_ms_per_request"]
    ok = vc <= args.target_ms
    print(
        f"vcache CPU per request under load: {vc:.2f} ms "
        f"(target <= {args.target_ms}): {'ok' if ok else 'MISSED'}"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
