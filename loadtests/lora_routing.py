"""LoRA adapter routing on two CPU replicas: vcache's placement against round robin.

    .venv/bin/python -m loadtests.lora_routing

One mixed stream, the same in every arm: the base model and ``--adapters`` demo
adapters (random weights, built locally into a resolver directory, so none is loaded
when the gateway starts), each with ``--prompts`` system prompts of
``--system-words`` words that its requests share, a short user turn after.  Each
arm starts its own gateway (``vcache serve --replicas 2``, LoRA on, ``--slots``
adapters per replica) and sends the stream, ``--users`` requests at a time:

- ``vcache``: the gateway routes (its adapter placement, then the kv policy);
- ``round_robin``: the client sends request i to replica i mod 2
  (``x-vcache-replica``, an admin's header), as an adapter-blind balancer would: the
  gateway loads the adapter where it is sent (letting another go when the replica's
  slots are full).

Per arm: token-weighted hit rate (the engine's ``cached_tokens``), mean and p50/p90
TTFT (streamed), the gateway's predictions against the engine's counts, adapter
loads and evictions (``GET /v1/lora_adapters``), and the mean TTFT of each
adapter's first request against the rest (a load at request time).  Prints a
table and writes JSON under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from engines.vllm.demo_lora import DemoLoraSpec, ensure_demo_lora
from loadtests.admin_key import admin_env, bearer
from loadtests.procs import free_port, get_ok, serving

MODEL = "vcache-demo"
WORDS = (
    "cache block token model request answer system prompt value server client adapter "
    "replica route prefix weight layer rank index event session"
).split()


@dataclass(frozen=True)
class Sent:
    i: int
    model: str
    first: bool  # the first request under this model in the arm
    replica: str
    prompt_tokens: int
    cached: int
    predicted: int | None
    ttft_s: float
    ok: bool


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choices(WORDS, k=n))


def stream(args: argparse.Namespace, run: str) -> list[tuple[str, list[dict[str, str]]]]:
    """The arm's requests: (model, messages), the same models and shapes every arm."""
    rng = random.Random(args.seed)
    models = [MODEL] + [f"lr-{k}" for k in range(args.adapters)]
    systems = {
        (m, p): f"[{run}] {m} task {p}: " + _text(random.Random(f"{m}/{p}"), args.system_words)
        for m in models
        for p in range(args.prompts)
    }
    out = []
    for _ in range(args.requests):
        m = rng.choice(models)
        system = systems[(m, rng.randrange(args.prompts))]
        user = _text(rng, 30)
        out.append((m, [{"role": "system", "content": system}, {"role": "user", "content": user}]))
    return out


def send(
    client: httpx.Client,
    i: int,
    model: str,
    messages: list[dict[str, str]],
    headers: dict[str, str],
) -> tuple[str, int, int, int | None, float, bool]:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft: float | None = None
    usage: dict[str, Any] = {}
    with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            r.read()
            print(f"request {i} ({model}): {r.status_code} {r.text[:200]}", flush=True)
            return "", 0, 0, None, 0.0, False
        replica = r.headers.get("x-vcache-replica", "")
        raw = r.headers.get("x-vcache-predicted-cached-tokens")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                usage = chunk["usage"]
    details = usage.get("prompt_tokens_details") or {}
    return (
        replica,
        int(usage.get("prompt_tokens", 0)),
        int(details.get("cached_tokens") or 0),
        int(raw) if raw is not None else None,
        ttft if ttft is not None else time.perf_counter() - t0,
        True,
    )


def run_arm(name: str, host: str, args: argparse.Namespace) -> dict[str, Any]:
    run = f"{name}-{time.time_ns():x}"
    reqs = stream(args, run)
    seen: set[str] = set()
    firsts = []
    for m, _ in reqs:
        firsts.append(m not in seen)
        seen.add(m)
    lock = threading.Lock()
    results: list[Sent] = []
    with httpx.Client(base_url=host, headers=bearer(), timeout=300) as client:

        def one(i: int) -> None:
            model, messages = reqs[i]
            headers = {"x-vcache-replica": f"replica-{i % 2}"} if name == "round_robin" else {}
            got = send(client, i, model, messages, headers)
            with lock:
                results.append(Sent(i, model, firsts[i], *got))

        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.users) as pool:
            list(pool.map(one, range(len(reqs))))
        elapsed = time.perf_counter() - t0
        listed = client.get("/v1/lora_adapters").json()
    return summary(name, sorted(results, key=lambda s: s.i), elapsed, listed)


def summary(name: str, rows: list[Sent], elapsed: float, listed: dict[str, Any]) -> dict[str, Any]:
    ok = [r for r in rows if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    ttfts = sorted(r.ttft_s for r in ok)
    first = [r.ttft_s for r in ok if r.first and r.model != MODEL]
    rest = [r.ttft_s for r in ok if not r.first and r.model != MODEL]
    predicted = [r for r in ok if r.predicted is not None]
    return {
        "arm": name,
        "requests": len(rows),
        "errors": len(rows) - len(ok),
        "elapsed_s": round(elapsed, 1),
        "hit_rate": round(sum(r.cached for r in ok) / prompt, 4) if prompt else 0.0,
        "ttft_mean_ms": round(1000 * statistics.fmean(ttfts), 1) if ttfts else None,
        "ttft_p50_ms": round(1000 * ttfts[len(ttfts) // 2], 1) if ttfts else None,
        "ttft_p90_ms": round(1000 * ttfts[int(len(ttfts) * 0.9)], 1) if ttfts else None,
        "predicted_exact": f"{sum(r.predicted == r.cached for r in predicted)}/{len(predicted)}",
        "adapter_first_ttft_ms": round(1000 * statistics.fmean(first), 1) if first else None,
        "adapter_rest_ttft_ms": round(1000 * statistics.fmean(rest), 1) if rest else None,
        "loads": listed.get("loads"),
        "evictions": listed.get("evictions"),
        "adapters": {
            e["lora_name"]: {
                "replicas": e["replicas"],
                "load_seconds": e.get("load_seconds"),
                "load_bytes": e.get("load_bytes"),
            }
            for e in listed.get("data", [])
        },
        "rows": [asdict(r) for r in rows],
    }


def demo_model() -> Path:
    out = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "demo-model"],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(out.stdout.strip().splitlines()[-1])


@contextmanager
def gateway(name: str, args: argparse.Namespace, resolve: Path) -> Iterator[str]:
    port = free_port()
    host = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port)]
    cmd += ["--grpc-port", str(free_port()), "--replicas", "2"]
    cmd += ["--kv-cache-bytes", str(args.kv_bytes), "--max-model-len", "2048"]
    env = {
        **os.environ,
        "VCACHE_DATA_DIR": str(args.out / f"data-{name}"),
        "VCACHE_ENGINE__LORA__ENABLED": "true",
        "VCACHE_ENGINE__LORA__MAX_LORAS": str(args.slots),
        "VCACHE_ENGINE__LORA__MAX_CPU_LORAS": str(args.slots),
        "VCACHE_ENGINE__LORA__MAX_LORA_RANK": "8",
        "VCACHE_ENGINE__LORA__RESOLVER_DIR": str(resolve),
        **admin_env(),
    }
    with serving(cmd, lambda: get_ok(f"{host}/readyz"), args.out / f"{name}.log", env):
        yield host


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'arm':<12}{'req':>5}{'err':>5}{'hit':>8}{'ttft mean':>11}{'p50':>8}{'p90':>8}"
        f"{'first':>8}{'rest':>8}{'loads':>7}{'evict':>7}{'exact':>9}"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['arm']:<12}{r['requests']:>5}{r['errors']:>5}{r['hit_rate']:>8.3f}"
            f"{r['ttft_mean_ms'] or 0:>11.0f}{r['ttft_p50_ms'] or 0:>8.0f}"
            f"{r['ttft_p90_ms'] or 0:>8.0f}{r['adapter_first_ttft_ms'] or 0:>8.0f}"
            f"{r['adapter_rest_ttft_ms'] or 0:>8.0f}{r['loads'] or 0:>7}"
            f"{r['evictions'] or 0:>7}{r['predicted_exact']:>9}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=2, help="system prompts per model")
    ap.add_argument("--system-words", type=int, default=300)
    ap.add_argument("--requests", type=int, default=80)
    ap.add_argument("--users", type=int, default=2)
    ap.add_argument("--slots", type=int, default=2, help="adapters per replica")
    ap.add_argument("--kv-bytes", type=int, default=32 << 20, help="per replica")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--arms", default="vcache,round_robin")
    ap.add_argument(
        "--out", type=Path, default=Path("reports") / time.strftime("lora-%Y%m%d-%H%M%S")
    )
    args = ap.parse_args(argv)
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    base = demo_model()
    resolve = args.out / "adapters"
    for k in range(args.adapters):
        built = ensure_demo_lora(args.out / "built", base, f"lr-{k}", DemoLoraSpec(seed=11 + k))
        if not (resolve / f"lr-{k}").exists():
            shutil.copytree(built, resolve / f"lr-{k}")
    rows = []
    for name in args.arms.split(","):
        with gateway(name, args, resolve) as host:
            rows.append(run_arm(name, host, args))
        print(f"{name}: hit {rows[-1]['hit_rate']}", flush=True)
    text = table(rows)
    print(text)
    (args.out / "lora_routing.json").write_text(
        json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "arms": rows}, indent=2)
    )
    (args.out / "lora_routing.txt").write_text(text + "\n")
    return 0 if all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
