"""An interactive prompt beside a busy replica: computed whole, or in vLLM's chunks.

    .venv/bin/python loadtests/bench_top_prefill.py --out /tmp/top-prefill

One replica (``engine.max_num_seqs`` 4, a long-prefill cap of ``--cap``
tokens) kept busy by ``--bg-streams`` clients at default priority, each
sending a fresh ``--bg-tokens`` prompt for a ``--bg-answer``-token answer,
back to back.  Beside them one interactive client sends fresh
``--prompt-tokens`` prompts, one at a time with a random pause between.
Gateways alternate with ``engine.top_prefill_whole`` on and off,
``--rounds`` times each, so the drift of a shared machine falls on both.

Per setting: the interactive requests' TTFT p50/p90 as the client saw it,
and the gateway's phases for them (``vcache_ttft_phase_seconds``).  Prints a
table and writes ``top_prefill.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from procs import free_port, get_ok, serving  # noqa: E402
from report import parse_metrics, percentile, phases_table, ttft_phases  # noqa: E402
from run import token_counter  # noqa: E402
from workloads import VOCAB  # noqa: E402

MODEL = "vcache-demo"


def _prompt(rng: random.Random, tokens: int, count: Any) -> str:
    """A fresh prompt of about ``tokens`` tokens (nothing of it is cached)."""
    words = [f"n{rng.getrandbits(40):x}", *rng.choices(VOCAB, k=tokens)]
    while count(" ".join(words)) > tokens:
        words = words[: int(len(words) * 0.95)]
    return " ".join(words)


def _ttft(client: httpx.Client, prompt: str, max_tokens: int, priority: str) -> float | None:
    """Seconds to the first streamed token (None: the request failed)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    t0 = time.perf_counter()
    with client.stream("POST", "/v1/completions", json=body,
                       headers={"x-vcache-priority": priority}) as resp:  # fmt: skip
        if resp.status_code != 200:
            return None
        first = None
        for line in resp.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - t0
        return first


def _background(host: str, args: argparse.Namespace, count: Any, stop: threading.Event) -> None:
    rng = random.Random()
    with httpx.Client(base_url=host, timeout=120) as client:
        while not stop.is_set():
            _ttft(client, _prompt(rng, args.bg_tokens, count), args.bg_answer, "default")


def measure(host: str, args: argparse.Namespace, count: Any, seed: int) -> dict[str, Any]:
    """One round: the background running, ``--requests`` interactive prompts."""
    stop = threading.Event()
    threads = [threading.Thread(target=_background, args=(host, args, count, stop))
               for _ in range(args.bg_streams)]  # fmt: skip
    for t in threads:
        t.start()
    rng = random.Random(seed)
    prompts = [_prompt(rng, args.prompt_tokens, count) for _ in range(args.requests)]
    time.sleep(3)  # the background reaches its steady state
    before = parse_metrics(httpx.get(f"{host}/metrics", timeout=10).text)
    ttfts: list[float] = []
    failed = 0
    with httpx.Client(base_url=host, timeout=120) as client:
        for p in prompts:
            time.sleep(rng.uniform(0.2, 0.6))
            got = _ttft(client, p, 4, "interactive")
            if got is None:
                failed += 1
            else:
                ttfts.append(1000 * got)
    after = parse_metrics(httpx.get(f"{host}/metrics", timeout=10).text)
    stop.set()
    for t in threads:
        t.join()
    return {"ttft_ms": ttfts, "failed": failed,
            "phases": ttft_phases(before, after, "interactive")}  # fmt: skip


def gateway_round(out: Path, args: argparse.Namespace, whole: bool, i: int, count: Any) -> Any:
    port = free_port()
    host = f"http://127.0.0.1:{port}"
    tag = f"{'whole' if whole else 'chunked'}-{i}"
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port),
           "--grpc-port", str(free_port()), "--replicas", "1"]  # fmt: skip
    env = {**os.environ, "VCACHE_DATA_DIR": str(out / f"data-{tag}"),
           "VCACHE_ENGINE__MAX_NUM_SEQS": "4",
           "VCACHE_ENGINE__LONG_PREFILL_TOKEN_THRESHOLD": str(args.cap),
           "VCACHE_ENGINE__TOP_PREFILL_WHOLE": "true" if whole else "false"}  # fmt: skip
    with serving(cmd, lambda: get_ok(f"{host}/readyz"), out / f"gateway-{tag}.log", env):
        row = measure(host, args, count, seed=i)
    print(f"{tag}: ttft p50 {percentile(row['ttft_ms'], 50):.0f} "
          f"p90 {percentile(row['ttft_ms'], 90):.0f} ms", flush=True)  # fmt: skip
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/vcache-top-prefill"))
    ap.add_argument("--rounds", type=int, default=2, help="gateways per setting")
    ap.add_argument("--requests", type=int, default=30, help="interactive prompts a round")
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--cap", type=int, default=256, help="long_prefill_token_threshold")
    ap.add_argument("--bg-streams", type=int, default=3)
    ap.add_argument("--bg-tokens", type=int, default=400)
    ap.add_argument("--bg-answer", type=int, default=32)
    ap.add_argument("--tokenizer", default=None, help="the served model's; default: demo")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    count = token_counter(args.tokenizer)
    rows: dict[str, list[Any]] = {"whole": [], "chunked": []}
    for i in range(args.rounds):
        for whole in (True, False) if i % 2 == 0 else (False, True):
            rows["whole" if whole else "chunked"].append(
                gateway_round(args.out, args, whole, i, count)
            )
    table: list[dict[str, Any]] = []
    lines = [f"{'setting':<10}{'requests':>9}{'failed':>8}{'ttft p50':>10}{'p90':>7}"]
    for name, rounds in rows.items():
        ttfts = [t for r in rounds for t in r["ttft_ms"]]
        failed = sum(r["failed"] for r in rounds)
        p50, p90 = percentile(ttfts, 50) or 0.0, percentile(ttfts, 90) or 0.0
        lines.append(f"{name:<10}{len(ttfts):>9}{failed:>8}{p50:>10.0f}{p90:>7.0f}")
        phases = {p: _mean_of(rounds, p) for p in rounds[0]["phases"]}
        table.append({"arm": name, "ttft_ms": {"p50": p50, "p90": p90}, "failed": failed,
                      "phases": phases, "rounds": rounds})  # fmt: skip
    text = "\n".join(lines) + "\n\ninteractive TTFT in the gateway by phase, ms mean / p90:\n"
    text += phases_table(table)
    print(text)
    (args.out / "top_prefill.json").write_text(json.dumps(table, indent=2))
    (args.out / "top_prefill.txt").write_text(text + "\n")
    return 0


def _mean_of(rounds: list[Any], phase: str) -> dict[str, float | None]:
    """A phase over the rounds: its mean weighted by count, the rounds' largest p90."""
    got = [r["phases"][phase] for r in rounds if r["phases"][phase]["count"]]
    n = sum(g["count"] for g in got)
    mean = sum(g["mean_ms"] * g["count"] for g in got) / n if n else None
    p90s = [g["p90_ms"] for g in got if g["p90_ms"] is not None]
    return {"mean_ms": mean, "p90_ms": max(p90s) if p90s else None, "count": n}


if __name__ == "__main__":
    raise SystemExit(main())
