"""An interactive prompt beside a busy replica: how the engine and the gateway serve it.

    .venv/bin/python -m loadtests.bench_top_prefill --out /tmp/top-prefill

One replica (``engine.max_num_seqs`` 4, a long-prefill cap of ``--cap``
tokens) kept busy by ``--bg-streams`` clients at ``--bg-priority``, each
sending a fresh ``--bg-tokens`` prompt for a ``--bg-answer``-token answer,
back to back.  Beside them one interactive client sends fresh
``--prompt-tokens`` prompts, one at a time with a random pause between.
Each arm (``--arms``, :data:`ARMS`) is a gateway with its own settings; they
take turns, ``--rounds`` times each, in an order reversed every round, so the
drift of a shared machine falls on all of them.  The arm ``alone`` has no
background: what the others add to a first token is measured against it.

Per arm: the interactive requests' TTFT p50/p90 as the client saw it, what
it adds to ``alone``'s, and the gateway's phases for them
(``vcache_ttft_phase_seconds``).  The ``submit`` phase is the wait for the
engine step running when the request came (the core reads its input only
between steps): the issue's bound is that a lower class adds at most that one
step.  Prints a table and writes ``top_prefill.json``.
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

from loadtests.procs import free_port, get_ok, serving
from loadtests.report import parse_metrics, percentile, phases_table, ttft_phases
from loadtests.run import token_counter
from loadtests.workloads import VOCAB

MODEL = "vcache-demo"

_OFF = "false"
_CORE = {"FIRST_TOKEN_GUARD": _OFF, "PREEMPT_PREFILLS": _OFF}  # the core's hold, no more
# arm -> (a background?, the gateway's settings beyond the cap and max_num_seqs, workers)
ARMS: dict[str, tuple[bool, dict[str, str], int]] = {
    "alone": (False, {}, 1),  # the defaults, nothing beside the interactive prompts
    "chunked": (True, {"TOP_PREFILL_WHOLE": _OFF, "TOP_PREFILL_ALONE": _OFF}, 1),
    "whole": (True, {"TOP_PREFILL_ALONE": _OFF}, 1),  # the gateway's guard and stops
    "held": (True, {}, 1),  # the defaults: whole, alone, guard and stops
    "engine": (True, _CORE, 1),
    "decodes": (True, {"TOP_PREFILL_DECODES": "true"}, 1),  # held: the decodes wait too
    "engine-decodes": (True, {**_CORE, "TOP_PREFILL_DECODES": "true"}, 1),
    # two worker processes on one engine core: each one's guard and stops see only the
    # requests it serves (gateway/workers.py); the core's hold sees them all
    "workers": (True, {"TOP_PREFILL_ALONE": _OFF}, 2),
    "workers-held": (True, {}, 2),
}


def _prompt(rng: random.Random, tokens: int, count: Any) -> str:
    """A fresh prompt of about ``tokens`` tokens (nothing of it is cached)."""
    words = [f"n{rng.getrandbits(40):x}", *rng.choices(VOCAB, k=tokens)]
    while count(" ".join(words)) > tokens:
        words = words[: int(len(words) * 0.95)]
    return " ".join(words)


def _ttft(client: httpx.Client, prompt: str, max_tokens: int, priority: str) -> float | None:
    """Seconds to the first streamed token (None: the request failed)."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
    }
    t0 = time.perf_counter()
    with client.stream(
        "POST", "/v1/completions", json=body, headers={"x-vcache-priority": priority}
    ) as resp:
        if resp.status_code != 200:
            return None
        first = None
        for line in resp.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - t0
        return first


def _background(
    host: str, args: argparse.Namespace, pool: list[str], stop: threading.Event, done: list[float]
) -> None:
    """Back-to-back requests until ``stop``; each one answered appends its end time.  The
    prompts are drawn from ``pool`` (tokenized before the round: the client shares the
    host's 2 cores), each behind a fresh nonce so nothing of it is cached."""
    rng = random.Random()
    with httpx.Client(base_url=host, timeout=120) as client:
        while not stop.is_set():
            p = f"n{rng.getrandbits(40):x} {rng.choice(pool)}"
            if _ttft(client, p, args.bg_answer, args.bg_priority) is not None:
                done.append(time.perf_counter())


def measure(
    host: str, args: argparse.Namespace, count: Any, seed: int, busy: bool
) -> dict[str, Any]:
    """One round: the background running (if ``busy``), ``--requests`` interactive
    prompts."""
    rng = random.Random(seed)
    prompts = [_prompt(rng, args.prompt_tokens, count) for _ in range(args.requests)]
    pool = [_prompt(rng, args.bg_tokens, count) for _ in range(32 if busy else 0)]
    stop, done = threading.Event(), list[float]()
    threads = [
        threading.Thread(target=_background, args=(host, args, pool, stop, done))
        for _ in range(args.bg_streams if busy else 0)
    ]
    for t in threads:
        t.start()
    time.sleep(3)  # the background reaches its steady state
    before = parse_metrics(httpx.get(f"{host}/metrics", timeout=10).text)
    t0 = time.perf_counter()
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
    elapsed = time.perf_counter() - t0
    stop.set()
    for t in threads:
        t.join()
    stops = after.get("vcache_prefill_stops_total", 0.0) - before.get(
        "vcache_prefill_stops_total", 0.0
    )
    return {
        "ttft_ms": ttfts,
        "failed": failed,
        "seconds": elapsed,
        "bg_done": len([t for t in done if t0 <= t <= t0 + elapsed]),
        "stops": stops,
        "phases": ttft_phases(before, after, "interactive"),
    }


def gateway_round(out: Path, args: argparse.Namespace, arm: str, i: int, count: Any) -> Any:
    port = free_port()
    host = f"http://127.0.0.1:{port}"
    tag = f"{arm}-{i}"
    busy, settings, workers = ARMS[arm]
    cmd = [
        sys.executable,
        "-m",
        "gateway.cli",
        "serve",
        "--port",
        str(port),
        "--grpc-port",
        str(free_port()),
        "--replicas",
        "1",
        "--workers",
        str(workers),
    ]
    env = {
        **os.environ,
        "VCACHE_DATA_DIR": str(out / f"data-{tag}"),
        "VCACHE_ENGINE__MAX_NUM_SEQS": "4",
        "VCACHE_ENGINE__LONG_PREFILL_TOKEN_THRESHOLD": str(args.cap),
        "VCACHE_ENGINE__MAX_MODEL_LEN": str(args.max_model_len),
        **{f"VCACHE_ENGINE__{k}": v for k, v in settings.items()},
    }
    with serving(cmd, lambda: get_ok(f"{host}/readyz"), out / f"gateway-{tag}.log", env):
        row = measure(host, args, count, seed=i, busy=busy)
    print(
        f"{tag}: ttft p50 {percentile(row['ttft_ms'], 50):.0f} "
        f"p90 {percentile(row['ttft_ms'], 90):.0f} ms",
        flush=True,
    )
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/vcache-top-prefill"))
    ap.add_argument("--rounds", type=int, default=2, help="gateways per setting")
    ap.add_argument("--requests", type=int, default=30, help="interactive prompts a round")
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--cap", type=int, default=256, help="long_prefill_token_threshold")
    ap.add_argument(
        "--arms", default="alone,whole,held,engine", help=f"comma-separated, of {', '.join(ARMS)}"
    )
    ap.add_argument("--bg-priority", default="default", choices=("default", "batch"))
    ap.add_argument("--bg-streams", type=int, default=3)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--bg-tokens", type=int, default=400)
    ap.add_argument("--bg-answer", type=int, default=32)
    ap.add_argument("--tokenizer", default=None, help="the served model's; default: demo")
    args = ap.parse_args(argv)
    arms = args.arms.split(",")
    if unknown := set(arms) - set(ARMS):
        ap.error(f"unknown arms: {', '.join(sorted(unknown))}")
    args.out.mkdir(parents=True, exist_ok=True)
    count = token_counter(args.tokenizer)
    rows: dict[str, list[Any]] = {a: [] for a in arms}
    for i in range(args.rounds):
        for arm in arms if i % 2 == 0 else arms[::-1]:
            rows[arm].append(gateway_round(args.out, args, arm, i, count))
    table = [_row(name, rounds) for name, rounds in rows.items()]
    text = _text(table) + "\n\ninteractive TTFT in the gateway by phase, ms mean / p90:\n"
    text += phases_table(table)
    print(text)
    (args.out / "top_prefill.json").write_text(json.dumps(table, indent=2))
    (args.out / "top_prefill.txt").write_text(text + "\n")
    return 0


def _row(name: str, rounds: list[Any]) -> dict[str, Any]:
    ttfts = [t for r in rounds for t in r["ttft_ms"]]
    p50, p90 = percentile(ttfts, 50) or 0.0, percentile(ttfts, 90) or 0.0
    phases = {p: _mean_of(rounds, p) for p in rounds[0]["phases"]}
    seconds = sum(r["seconds"] for r in rounds)
    return {
        "arm": name,
        "requests": len(ttfts),
        "ttft_ms": {"p50": p50, "p90": p90},
        "failed": sum(r["failed"] for r in rounds),
        "phases": phases,
        "bg_rps": sum(r["bg_done"] for r in rounds) / seconds if seconds else 0.0,
        "stops": sum(r["stops"] for r in rounds),
        "rounds": rounds,
    }


def _text(table: list[dict[str, Any]]) -> str:
    """TTFT per arm, what it adds to ``alone``'s, the step it found running, and what
    the background got done (its requests answered a second, the prefill stops)."""
    base = next((r["ttft_ms"] for r in table if r["arm"] == "alone"), None)
    lines = [
        f"{'arm':<15}{'requests':>9}{'failed':>7}{'ttft p50':>9}{'p90':>6}"
        f"{'added p50':>10}{'p90':>6}{'submit p90':>11}{'bg rps':>8}{'stops':>6}"
    ]
    for r in table:
        t, n = r["ttft_ms"], r["requests"]
        added = (
            f"{t['p50'] - base['p50']:>10.0f}{t['p90'] - base['p90']:>6.0f}"
            if base
            else f"{'-':>10}{'-':>6}"
        )
        submit = r["phases"].get("submit", {}).get("p90_ms")
        step = f"{submit:>11.0f}" if submit is not None else f"{'-':>11}"
        lines.append(
            f"{r['arm']:<15}{n:>9}{r['failed']:>7}{t['p50']:>9.0f}{t['p90']:>6.0f}"
            f"{added}{step}{r['bg_rps']:>8.2f}{r['stops']:>6.0f}"
        )
    return "\n".join(lines)


def _mean_of(rounds: list[Any], phase: str) -> dict[str, float | None]:
    """A phase over the rounds: its mean weighted by count, the rounds' largest p90."""
    got = [r["phases"][phase] for r in rounds if r["phases"][phase]["count"]]
    n = sum(g["count"] for g in got)
    mean = sum(g["mean_ms"] * g["count"] for g in got) / n if n else None
    p90s = [g["p90_ms"] for g in got if g["p90_ms"] is not None]
    return {"mean_ms": mean, "p90_ms": max(p90s) if p90s else None, "count": n}


if __name__ == "__main__":
    raise SystemExit(main())
