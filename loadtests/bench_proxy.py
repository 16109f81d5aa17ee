"""The provider path's own cost against LiteLLM proxy's, interleaved in one run.

    .venv/bin/python loadtests/bench_proxy.py --litellm /path/to/venv/bin/litellm

One fixed upstream (the emulator's OpenAI route), two proxies in front of it:
``vcache serve`` (provider-only, the session log on, as deployed) and
LiteLLM's proxy (installed in a venv of its own: ``python -m venv V &&
V/bin/pip install 'litellm[proxy]'``).  The same non-streamed chat request
(a ~1k-token system prompt and a question) goes to each in turn, A B A B,
from one client, after a warm-up; each proxy's CPU time (user + system, its
process and children, from ``/proc`` through psutil) is read before and
after.  Prints per proxy: CPU ms per request, median and p90 latency, and the
direct-to-upstream latency for reference; writes JSON; exits 1 when vcache's
CPU per request is above ``--target-ms`` (1.5).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE)]

from procs import free_port, get_ok, serving  # noqa: E402

SYSTEM = "You answer questions about the vcache manual, one section at a time.\n" * 60


def cpu_s(pid: int) -> float:
    p = psutil.Process(pid)
    total: float = sum(p.cpu_times()[:2])
    for c in p.children(recursive=True):
        try:
            total += sum(c.cpu_times()[:2])
        except psutil.NoSuchProcess:
            continue
    return total


def body(i: int) -> dict[str, Any]:
    return {
        "model": "gpt-5",
        "max_tokens": 8,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"question {i}: what does section {i % 50} say?"},
        ],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    emu_port, vc_port, ll_port = free_port(), free_port(), free_port()
    emu = f"http://127.0.0.1:{emu_port}"
    work = Path(tempfile.mkdtemp(prefix="bench-proxy-"))
    env = {**os.environ, "PYTHONPATH": str(HERE.parent), "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    vc_env = {
        **env,
        "VCACHE_DATA_DIR": str(work / "vcache"),
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
    vcache = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(vc_port)]
    vcache += ["--grpc-port", str(free_port())]
    litellm = [args.litellm, "--config", str(cfg), "--port", str(ll_port), "--num_workers", "1"]
    proxies = {"vcache": (vc_port, "openai/gpt-5"), "litellm": (ll_port, "gpt-5")}
    vc_ready = f"http://127.0.0.1:{vc_port}/readyz"
    ll_ready = f"http://127.0.0.1:{ll_port}/health/liveliness"
    with (
        serving(emulator, lambda: get_ok(f"{emu}/admin/requests"), work / "emu.log", env),
        serving(vcache, lambda: get_ok(vc_ready), work / "vc.log", vc_env) as vc,
        serving(litellm, lambda: get_ok(ll_ready), work / "ll.log", env) as ll,
        httpx.Client(timeout=30) as client,
    ):
        pids = {"vcache": vc.pid, "litellm": ll.pid}
        lat: dict[str, list[float]] = {"vcache": [], "litellm": [], "upstream": []}

        def send(name: str, i: int) -> float:
            if name == "upstream":
                url, b = f"{emu}/v1/chat/completions", body(i)
                headers = {"authorization": "Bearer k"}
            else:
                port, model = proxies[name]
                url, b = f"http://127.0.0.1:{port}/v1/chat/completions", {**body(i), "model": model}
                headers = {"authorization": "Bearer sk-bench"}
            t0 = time.perf_counter()
            r = client.post(url, json=b, headers=headers)
            took = time.perf_counter() - t0
            if r.status_code != 200:
                raise SystemExit(f"{name}: HTTP {r.status_code}: {r.text[:300]}")
            return took

        for i in range(args.warmup):
            for name in ("vcache", "litellm", "upstream"):
                send(name, i)
        before = {n: cpu_s(p) for n, p in pids.items()}
        for i in range(args.requests):
            for name in ("vcache", "litellm", "upstream"):
                lat[name].append(send(name, args.warmup + i))
        after = {n: cpu_s(p) for n, p in pids.items()}
    out: dict[str, Any] = {"requests": args.requests, "proxies": {}}
    for name in ("vcache", "litellm", "upstream"):
        xs = sorted(lat[name])
        row: dict[str, Any] = {
            "latency_p50_ms": statistics.median(xs) * 1e3,
            "latency_p90_ms": xs[int(len(xs) * 0.9)] * 1e3,
        }
        if name in pids:
            row["cpu_ms_per_request"] = (after[name] - before[name]) / args.requests * 1e3
        out["proxies"][name] = row
    p = out["proxies"]
    out["cpu_ratio_litellm_over_vcache"] = p["litellm"]["cpu_ms_per_request"] / max(
        p["vcache"]["cpu_ms_per_request"], 1e-9
    )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--litellm", required=True, help="the litellm executable (its own venv)")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--target-ms", type=float, default=1.5)
    ap.add_argument("--out", type=Path, default=Path("reports/bench_proxy.json"))
    args = ap.parse_args(argv)
    out = run(args)
    print(f"{'proxy':<10}{'CPU ms/req':>12}{'p50 ms':>9}{'p90 ms':>9}")
    for name, r in out["proxies"].items():
        cpu = r.get("cpu_ms_per_request")
        cpu_s_ = "-" if cpu is None else f"{cpu:.2f}"
        print(f"{name:<10}{cpu_s_:>12}{r['latency_p50_ms']:>9.2f}{r['latency_p90_ms']:>9.2f}")
    ratio = out["cpu_ratio_litellm_over_vcache"]
    vc = out["proxies"]["vcache"]["cpu_ms_per_request"]
    ok = vc <= args.target_ms
    print(f"LiteLLM / vcache CPU: {ratio:.2f}x; vcache {vc:.2f} ms "
          f"(target <= {args.target_ms}): {'ok' if ok else 'MISSED'}")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
