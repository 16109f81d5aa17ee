"""The batch workload's local-replica arm (issue 52), scaled down for a CPU host: the
prefix-cache hit rate and wall time of a batch run by vcache's batch API (the prefix
DAG's order, send-one-then-fan) against the same items sent online in arrival order
through vcache, and against vLLM's own OpenAI server given them in arrival order.

``python -m loadtests.batch_local [--units 240] [--anchors 24] [--s 1.0] [--out DIR]``

The held-out scale (issue 52): ``--units 10000 --anchors 1000 --s 0.8 1.0 1.74``.

The workload is :mod:`loadtests.batch_workload`'s: ``units`` units of
``--unit-tokens`` (10-50) under ``anchors`` system prompts of ``--anchor-tokens``
(1,000-4,000), both in the demo model's tokens (the texts are drawn in the emulator's
tokens and scaled by the demo tokenizer's ratio, measured on a sample; the engine
counts the prompts it was sent), the anchor drawn from Zipf(s), in random arrival
order; chat completions of one output token on the demo model.  Each arm runs on a
fresh engine with the same KV cache size (``--kv-bytes``, a small share of the anchors'
total, so not every anchor stays resident) and the same concurrency
(``--concurrency``, the batch runner's default 8).  Each s's result is written as
soon as it is measured.  The hit rate is the engine's own count: the sum of ``cached_tokens`` over
the sum of ``prompt_tokens``.  Prints a table and writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from gateway.core.config import Settings
from gateway.local.build import resolve_model
from loadtests.batch_workload import filler, workload
from loadtests.procs import free_port, get_ok, serving
from manifest.economics import zipf_coverage

MODEL = "vcache-demo"


def bodies(texts: list[str], which: list[int], own: list[str]) -> list[dict[str, Any]]:
    return [
        {
            "model": MODEL,
            "max_tokens": 1,
            "messages": [
                {"role": "system", "content": texts[a]},
                {"role": "user", "content": own[i]},
            ],
        }
        for i, a in enumerate(which)
    ]


def token_ratio(model: str, seed: int) -> float:
    """The demo model's tokens per emulator token of
    :func:`~loadtests.batch_workload.filler`, on a sample."""

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    sample = filler(random.Random(seed), 4000)
    return float(len(tok(sample)["input_ids"])) / 4000


def scaled(span: tuple[int, int], ratio: float) -> tuple[int, int]:
    return (max(1, round(span[0] / ratio)), max(1, round(span[1] / ratio)))


def hit_rate(usages: list[dict[str, Any]]) -> dict[str, Any]:
    prompt = sum(int(u["prompt_tokens"]) for u in usages)
    cached = sum(
        int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0) for u in usages
    )
    return {
        "items": len(usages),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": round(cached / prompt, 4) if prompt else None,
    }


async def online(host: str, items: list[dict[str, Any]], concurrency: int) -> list[dict[str, Any]]:
    """``items`` sent in arrival order, ``concurrency`` at a time; their usages."""
    slots = asyncio.Semaphore(concurrency)
    out: list[dict[str, Any]] = [{} for _ in items]

    async def one(http: httpx.AsyncClient, i: int) -> None:
        async with slots:
            r = await http.post("/v1/chat/completions", json=items[i])
            r.raise_for_status()
            out[i] = r.json()["usage"]

    async with httpx.AsyncClient(base_url=host, timeout=600) as http:
        tasks = []
        for i in range(len(items)):
            await slots.acquire()  # started in arrival order
            slots.release()
            tasks.append(asyncio.create_task(one(http, i)))
        await asyncio.gather(*tasks)
    return out


def batch(host: str, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``items`` as one batch through vcache's Batch API; their usages once it ended."""
    lines = [
        {"custom_id": f"u{i}", "method": "POST", "url": "/v1/chat/completions", "body": b}
        for i, b in enumerate(items)
    ]
    data = b"".join(json.dumps(ln).encode() + b"\n" for ln in lines)
    with httpx.Client(base_url=host, timeout=600) as http:
        f = http.post("/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"})
        f.raise_for_status()
        spec = {
            "input_file_id": f.json()["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        }
        b = http.post("/v1/batches", json=spec)
        b.raise_for_status()
        while (row := http.get(f"/v1/batches/{b.json()['id']}").json())["status"] != "completed":
            if row["status"] in ("failed", "cancelled", "expired"):
                raise SystemExit(f"the batch ended {row['status']}")
            time.sleep(0.2)
        if row["request_counts"]["failed"]:
            raise SystemExit(f"{row['request_counts']['failed']} items failed")
        content = http.get(f"/v1/files/{row['output_file_id']}/content").content
    answers = [json.loads(x) for x in content.splitlines() if x.strip()]
    return [a["response"]["body"]["usage"] for a in answers]


def gateway(out: Path, name: str, args: argparse.Namespace) -> Any:
    port = free_port()
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port)]
    cmd += ["--grpc-port", str(free_port()), "--replicas", "1"]
    cmd += ["--kv-cache-bytes", str(args.kv_bytes), "--max-model-len", str(args.max_model_len)]
    env = {**os.environ, "VCACHE_DATA_DIR": tempfile.mkdtemp(prefix=f"batch-{name}-")}
    host = f"http://127.0.0.1:{port}"
    return host, serving(cmd, lambda: get_ok(f"{host}/readyz"), out / f"{name}.log", env)


def vllm(out: Path, model: str, args: argparse.Namespace) -> Any:
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    cmd += ["--served-model-name", MODEL, "--port", str(port)]
    cmd += ["--max-model-len", str(args.max_model_len)]
    cmd += ["--kv-cache-memory-bytes", str(args.kv_bytes), "--enable-prefix-caching"]
    cmd += ["--enable-prompt-tokens-details"]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    host = f"http://127.0.0.1:{port}"
    return host, serving(cmd, lambda: get_ok(f"{host}/v1/models"), out / "vllm.log", env)


def run_s(args: argparse.Namespace, s: float, model: str, ratio: float) -> dict[str, Any]:
    anchor, unit = scaled(args.anchor_tokens, ratio), scaled(args.unit_tokens, ratio)
    texts, which, own = workload(args.units, args.anchors, s, args.seed, anchor, unit)
    items = bodies(texts, which, own)
    counts = Counter(which)
    top7 = sum(c for _, c in counts.most_common(7)) / len(which)
    arms: dict[str, Any] = {}
    host, ctx = gateway(args.out, f"vcache-batch-{s}", args)
    with ctx:
        t0 = time.perf_counter()
        usages = batch(host, items)
        arms["vcache_batch_dag"] = {
            **hit_rate(usages),
            "wall_s": round(time.perf_counter() - t0, 1),
        }
    host, ctx = gateway(args.out, f"vcache-arrival-{s}", args)
    with ctx:
        t0 = time.perf_counter()
        usages = asyncio.run(online(host, items, args.concurrency))
        arms["vcache_arrival"] = {**hit_rate(usages), "wall_s": round(time.perf_counter() - t0, 1)}
    host, ctx = vllm(args.out, model, args)
    with ctx:
        t0 = time.perf_counter()
        usages = asyncio.run(online(host, items, args.concurrency))
        arms["vllm_arrival"] = {**hit_rate(usages), "wall_s": round(time.perf_counter() - t0, 1)}
    for name, a in arms.items():
        print(f"s={s} {name}: hit {a['hit_rate']} in {a['wall_s']} s", flush=True)
    return {
        "s": s,
        "units": args.units,
        "anchors": args.anchors,
        "anchor_tokens": list(args.anchor_tokens),
        "unit_tokens": list(args.unit_tokens),
        "kv_bytes": args.kv_bytes,
        "top7_coverage": round(top7, 4),
        "top7_coverage_zipf": round(zipf_coverage(min(7, args.anchors), args.anchors, s), 4),
        "arms": arms,
    }


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        f"{'s':>5} {'arm':<20}{'items':>7}{'prompt tok':>12}{'cached':>10}{'hit':>8}{'wall s':>9}"
    ]
    for r in results:
        for name, a in r["arms"].items():
            lines.append(
                f"{r['s']:>5} {name:<20}{a['items']:>7}{a['prompt_tokens']:>12}"
                f"{a['cached_tokens']:>10}{a['hit_rate']:>8.3f}{a['wall_s']:>9.1f}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--units", type=int, default=240)
    p.add_argument("--anchors", type=int, default=24)
    p.add_argument("--s", type=float, nargs="+", default=[1.0])
    p.add_argument("--anchor-tokens", type=int, nargs=2, default=(1000, 4000), metavar=("LO", "HI"))
    p.add_argument("--unit-tokens", type=int, nargs=2, default=(10, 50), metavar=("LO", "HI"))
    p.add_argument("--kv-bytes", type=int, default=256 << 20, help="per engine")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=52)
    p.add_argument("--out", type=Path, default=Path("reports") / "batch-local")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    model = resolve_model(Settings())
    ratio = token_ratio(model, args.seed)
    print(f"demo tokens per emulator token: {ratio:.3f}", flush=True)
    results: list[dict[str, Any]] = []
    for s in args.s:
        results.append(run_s(args, s, model, ratio))
        (args.out / "batch_local.json").write_text(json.dumps(results, indent=1))
    print(table(results))
    print(f"\nwritten: {args.out / 'batch_local.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
