"""Gateway memory under sustained traffic: RSS must stay flat as requests accumulate.

Starts ``vcache serve`` (and, for the provider path, the provider emulator)
as separate processes, sends ``--requests`` requests over loopback, each a
new conversation with a prefix of its own (new sessions, new belief
entries, new KV blocks), and samples the gateway process's RSS (the engine
core is a child process and not counted).  The target: RSS at the end within
``--tolerance`` (10%) of RSS after the warm-up share of the run.  Prints a
table, writes JSON, exits 1 when a target is missed.

    python -m loadtests.bench_memory --path provider --requests 50000
    python -m loadtests.bench_memory --path local --requests 50000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from loadtests.procs import free_port, get_ok, serving

REPO = Path(__file__).resolve().parents[1]

WORDS = "cache block prefix anchor tenant replica token span warm pin lease evict".split()


def _prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _body(path: str, model: str, rng: random.Random, i: int) -> dict[str, Any]:
    system = f"conversation {i}: " + _prompt(rng, 120 if path == "local" else 400)
    turns = [{"role": "system", "content": system}]
    for t in range(rng.randint(0, 2)):  # some requests carry earlier turns
        turns += [
            {"role": "user", "content": f"q{t} " + _prompt(rng, 8)},
            {"role": "assistant", "content": _prompt(rng, 6)},
        ]
    turns.append({"role": "user", "content": "question: " + _prompt(rng, 10)})
    return {"model": model, "messages": turns, "max_tokens": 1}


async def _drive(
    base: str, path: str, model: str, n: int, concurrency: int, sample: Any
) -> tuple[int, float]:
    rng = random.Random(7)
    bodies = (_body(path, model, rng, i) for i in range(n))
    errors = 0
    done = 0
    t0 = time.perf_counter()
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:

        async def worker() -> None:
            nonlocal errors, done
            for body in bodies:
                r = await client.post("/v1/chat/completions", json=body)
                errors += r.status_code != 200
                done += 1
                sample(done)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return errors, time.perf_counter() - t0


def run(
    path: str, requests: int, concurrency: int, warmup: float, data_dir: Path
) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VCACHE_")}
    tmp = Path(tempfile.mkdtemp(prefix="vcache-mem-"))
    env["VCACHE_SESSION_LOG__PATH"] = str(tmp / "sessions.db")
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "gateway.cli",
        "serve",
        "--port",
        str(port),
        "--data-dir",
        str(data_dir),
        "--log-level",
        "warning",
        "--grpc-port",
        "0",
    ]
    base = f"http://127.0.0.1:{port}"
    with contextlib.ExitStack() as stack:
        if path == "provider":
            eport = free_port()
            emulator = [sys.executable, "-m", "loadtests.emulator", "--port", str(eport)]
            ready = functools.partial(get_ok, f"http://127.0.0.1:{eport}/admin/requests")
            stack.enter_context(serving(emulator, ready, tmp / "emulator.log", cwd=REPO))
            provider = {"base_url": f"http://127.0.0.1:{eport}/v1", "api_key": "sk-emulator"}
            env["VCACHE_PROVIDERS"] = json.dumps({"anthropic": provider})
            env["VCACHE_ENGINE__REPLICAS"] = "0"
            model = "anthropic/claude-sonnet-4-5"
        else:
            cmd += ["--kv-cache-bytes", str(64 << 20), "--enforce-eager"]
            model = "vcache-demo"
        ready = functools.partial(get_ok, f"{base}/readyz")
        gw = stack.enter_context(serving(cmd, ready, tmp / "gateway.log", env, REPO))
        proc = psutil.Process(gw.pid)
        samples: list[tuple[int, float]] = []
        every = max(1, requests // 50)

        def sample(done: int) -> None:
            if done % every == 0 or done == requests:
                samples.append((done, proc.memory_info().rss / 2**20))

        sample(0)
        errors, elapsed = asyncio.run(_drive(base, path, model, requests, concurrency, sample))
    after_warmup = next(rss for n, rss in samples if n >= requests * warmup)
    end = samples[-1][1]
    return {
        "path": path,
        "requests": requests,
        "errors": errors,
        "seconds": round(elapsed, 1),
        "rss_start_mib": round(samples[0][1], 1),
        "rss_after_warmup_mib": round(after_warmup, 1),
        "rss_end_mib": round(end, 1),
        "growth": round(end / after_warmup - 1, 4),
        "samples": samples,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--path", choices=["provider", "local", "both"], default="both")
    ap.add_argument("--requests", type=int, default=50_000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--warmup", type=float, default=0.2, help="share of the run before baseline")
    ap.add_argument("--tolerance", type=float, default=0.10)
    ap.add_argument("--data-dir", type=Path, default=REPO / ".vcache-test-data")
    ap.add_argument("--out", type=Path, default=REPO / "reports" / "bench_memory.json")
    a = ap.parse_args()
    paths = ["provider", "local"] if a.path == "both" else [a.path]
    results = [run(p, a.requests, a.concurrency, a.warmup, a.data_dir) for p in paths]
    cols = ("path", "requests", "errors", "s", "RSS start", "after warm-up", "end", "growth")
    print("{:<9} {:>8} {:>6} {:>7} {:>10} {:>13} {:>8} {:>7}  target".format(*cols))
    ok = True
    for r in results:
        hit = r["growth"] <= a.tolerance and r["errors"] == 0
        ok &= hit
        verdict = f"{'ok' if hit else 'MISSED'} (<= {a.tolerance:.0%}, 0 errors)"
        print(
            f"{r['path']:<9} {r['requests']:>8} {r['errors']:>6} {r['seconds']:>7} "
            f"{r['rss_start_mib']:>9}M {r['rss_after_warmup_mib']:>12}M {r['rss_end_mib']:>7}M "
            f"{r['growth']:>+7.1%}  {verdict}"
        )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"tolerance": a.tolerance, "results": results}, indent=1))
    print(f"wrote {a.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
