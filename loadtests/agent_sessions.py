"""Agent sessions under KV pressure: retention and affinity against plain KV routing,
round robin and vllm-router.

    .venv/bin/python loadtests/agent_sessions.py [--vllm-router PATH]

The workload (seeded, one run id per arm so no arm reads another's cache):
``--agent-types`` agent types, each a system prompt and tools shared by its
sessions; ``--sessions`` sessions of ``--turns`` turns, ``--users`` live at
once; every turn but the last calls a tool, whose result
(``--result-tokens`` range) comes back after a gap drawn log-normal (median
``--gap-median-s``, a tail to ``--gap-max-s``); one background tenant sends
short unrelated requests throughout.  Two replicas whose KV caches
(``--kv-bytes`` each) hold about half the live sessions' contexts.

Arms: ``retention`` (the default gateway: kv routing, session affinity, KV
leased across tool pauses), ``kv`` and ``round_robin`` (retention off, no
session names), and ``vllm_router`` (``--vllm-router``: its cache_aware
policy over two plain vLLM servers with the same model and KV size).

Per arm: the share of reusable prompt tokens served from cache (reusable: the
full blocks of the session's previous prompt, which the turn sends again),
TTFT p50/p90 of the continuation turns and of the first turns, and for vcache
the retention outcomes and prediction exactness.  Prints a table, writes
JSON; exits 1 on a missed target (retention >= 97% of reusable tokens, TTFT
p90 at least 2x better than round_robin).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import random
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from admin_key import api_keys_env, bearer, key_entry  # noqa: E402
from procs import free_port, get_ok, run_locust, serving, vllm_router  # noqa: E402
from report import parse_metrics, percentile, ttft_phases  # noqa: E402
from run import token_counter  # noqa: E402
from workloads import VOCAB  # noqa: E402

LEASED = 'vcache_session_retention_total{outcome="leased"}'
REFUSED = 'vcache_session_retention_total{outcome="refused"}'
PREEMPTED = 'vcache_session_retention_total{outcome="preempted"}'
LEASE_ROOM = 'vcache_routing_decisions_total{policy="kv",reason="lease_room"}'
STEPS = "engine_top_prefill_steps"  # not a gateway metric: read off /v1/cache/stats
ADMIN_KEY = "sk-agents-admin"
BACKGROUND_KEY = "sk-agents-background"


def _text(rng: random.Random, tokens: int, count: Any) -> str:
    words = rng.choices(VOCAB, k=tokens)
    text = " ".join(words)
    while count(text) > tokens:
        words = words[: int(len(words) * 0.9)]
        text = " ".join(words)
    return text


def _tools(rng: random.Random, agent: int) -> list[Any]:
    """The agent type's tools: the first (the one its turns call) takes an enum, so a
    random model's constrained arguments end; the others only make the prefix longer."""
    out: list[Any] = [{"type": "function", "function": {
        "name": f"run_{agent}", "description": f"Run step {agent} of the agent's plan",
        "parameters": {"type": "object", "additionalProperties": False,
                       "properties": {"step": {"enum": ["build", "test", "lint"]}},
                       "required": ["step"]}}}]  # fmt: skip
    for i in range(3):
        props = {w: {"type": "string", "description": " ".join(rng.choices(VOCAB, k=12))}
                 for w in rng.sample(VOCAB, 4)}  # fmt: skip
        out.append({"type": "function", "function": {
            "name": f"tool_{agent}_{i}", "description": " ".join(rng.choices(VOCAB, k=20)),
            "parameters": {"type": "object", "properties": props}}})  # fmt: skip
    return out


def workload(args: argparse.Namespace, run_id: str) -> dict[str, Any]:
    rng = random.Random(args.seed)
    count = args.count
    systems = [f"[run {run_id}] You are agent type {a}. " + _text(rng, args.system_tokens, count)
               for a in range(args.agent_types)]  # fmt: skip
    tools = {str(a): _tools(rng, a) for a in range(args.agent_types)}
    sigma = math.log(args.gap_max_s / args.gap_median_s) / 2.5  # the cap ~ 2.5 sigma out
    sessions = []
    for i in range(args.sessions):
        a = i % args.agent_types
        n = rng.randint(*args.turns)
        turns = [{"result": _text(rng, rng.randint(*args.result_tokens), count),
                  "gap_s": round(min(rng.lognormvariate(math.log(args.gap_median_s), sigma),
                                     args.gap_max_s), 3)}
                 for _ in range(n)]  # fmt: skip
        ask = f"Task {i}: " + _text(rng, 40, count)
        sessions.append({"id": f"{run_id}-s{i}", "agent": str(a), "system": systems[a],
                         "ask": ask, "turns": turns})  # fmt: skip
    background = [_text(rng, args.background_tokens, count) for _ in range(64)]
    return {"sessions": sessions, "tools": tools, "background": background}


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def summarize(rows: list[dict[str, str]]) -> dict[str, Any]:
    agent = [r for r in rows if r["kind"] == "agent"]
    ok = [r for r in agent if r["ok"] == "1"]
    later = [r for r in ok if int(r["turn"]) > 0]
    reusable = sum(int(r["reusable_tokens"]) for r in later)
    served = sum(min(int(r["cached_tokens"]), int(r["reusable_tokens"])) for r in later)
    ttft_later = [float(r["ttft_ms"]) for r in later]
    ttft_first = [float(r["ttft_ms"]) for r in ok if int(r["turn"]) == 0]
    bg = [r for r in rows if r["kind"] == "background"]
    return {
        "turns": len(ok),
        "errors": len(agent) - len(ok) + sum(r["ok"] != "1" for r in bg),
        "reusable_tokens": reusable,
        "reused_share": served / reusable if reusable else None,
        "hit_rate": sum(int(r["cached_tokens"]) for r in ok)
        / max(sum(int(r["prompt_tokens"]) for r in ok), 1),
        "ttft_ms_later": {"p50": percentile(ttft_later, 50), "p90": percentile(ttft_later, 90)},
        "ttft_ms_first": {"p50": percentile(ttft_first, 50), "p90": percentile(ttft_first, 90)},
        "background_requests": len(bg),
    }


def _keys(agents_priority: str = "default") -> dict[str, str]:
    """The gateway's keys: the agents' (an admin of their tenant: the kv and round_robin
    arms' ``x-vcache-routing``, ``/v1/cache/stats``) and the background tenant's."""
    return api_keys_env(
        key_entry(ADMIN_KEY, tenant="agents", name="agents", admin=True, priority=agents_priority),
        key_entry(BACKGROUND_KEY, tenant="background", name="bg"),
    )


def arm(name: str, host: str, out: Path, args: argparse.Namespace, env: dict[str, str]) -> Any:
    run_id = f"{name}-{time.time_ns():x}"
    wdir = out / name
    wdir.mkdir(parents=True, exist_ok=True)
    (wdir / "workload.json").write_text(json.dumps(workload(args, run_id)))
    bg = int(env.get("VCACHE_BACKGROUND_USERS") or os.environ.get("VCACHE_BACKGROUND_USERS", "1"))
    users = "AgentUser BackgroundUser" if bg else "AgentUser"
    env = {**env, "VCACHE_API_KEY": ADMIN_KEY, "VCACHE_BACKGROUND_KEY": BACKGROUND_KEY,
           "VCACHE_BACKGROUND_USERS": str(bg)}  # fmt: skip
    before = _metrics(host) if name != "vllm_router" else {}
    elapsed = run_locust(wdir / "workload.json", host, wdir, env, args.users + bg, args.limit_s,
                         users, locustfile="agents_locust.py")  # fmt: skip
    after = _metrics(host) if name != "vllm_router" else {}
    row = {"arm": name, "seconds": round(elapsed, 1), **summarize(_rows(wdir / "raw.csv"))}
    if after:
        row["gateway"] = {k: after.get(k, 0) - before.get(k, 0) for k in (
            'vcache_session_retention_total{outcome="leased"}',
            'vcache_session_retention_total{outcome="refused"}',
            'vcache_session_retention_total{outcome="released"}',
            PREEMPTED,
            'vcache_session_retention_total{outcome="yielded"}',
            'vcache_cached_token_predictions_total{outcome="matched"}',
            'vcache_cached_token_predictions_total{outcome="missed"}',
            'vcache_prefill_waits_total{outcome="joined"}',
            'vcache_routing_decisions_total{policy="kv",reason="session"}',
            LEASE_ROOM,
        )}  # fmt: skip
        row["step_ms"] = _step_ms(before, after)
        row["prefill_stops"] = _added(before, after, "vcache_prefill_stops_total")
        row["engine_steps"] = {  # what the engines' top-prefill patch did
            x: _added(before, after, STEPS, f'"{x}"') for x in ("uncapped", "held", "unfit")
        }
        row["phases"] = ttft_phases(before, after, "interactive")  # the fairness runs' agents
        row["loop"] = _loop(before, after)
        row["refreshed_blocks"] = {  # predicted blocks touched before the request ran
            x: _added(before, after, "vcache_kv_refreshed_blocks_total", f'result="{x}"')
            for x in ("touched", "missing")
        }
    print(f"{name}: {json.dumps(row)}", flush=True)
    return row


def _added(before: dict[str, float], after: dict[str, float], name: str, label: str = "") -> float:
    """How much a metric grew in the run, summed over its series (every replica; those
    with ``label`` in their labels)."""

    def total(m: dict[str, float]) -> float:
        return sum(v for k, v in m.items() if k.startswith(name) and label in k)

    return total(after) - total(before)


def _step_ms(before: dict[str, float], after: dict[str, float]) -> float | None:
    """The mean gap between streamed tokens in the run (every replica): an engine step
    under its load."""
    n = _added(before, after, "vcache_inter_token_latency_seconds_count")
    s = _added(before, after, "vcache_inter_token_latency_seconds_sum")
    return 1000 * s / n if n else None


def _loop(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The gateway's event loop in the run: its stalls (a ready callback waiting over
    250 ms), and the time its garbage collections took (ms, every generation; the
    oldest's full passes alone)."""
    lag, gc = "vcache_event_loop_lag_seconds", "vcache_gc_pause_seconds_sum"
    stalls = _added(before, after, f"{lag}_count") - _added(
        before, after, f"{lag}_bucket", 'le="0.25"'
    )
    return {"stalls": stalls, "gc_ms": 1000 * _added(before, after, gc),
            "gc2_ms": 1000 * _added(before, after, gc, 'generation="2"')}  # fmt: skip


def _metrics(host: str) -> dict[str, float]:
    """The gateway's metrics, and the steps its engines' top-prefill patch changed (from
    ``/v1/cache/stats``, summed over the replicas) as ``STEPS{outcome=...}``."""
    try:
        got = parse_metrics(httpx.get(f"{host}/metrics", timeout=10).text)
        stats = httpx.get(f"{host}/v1/cache/stats", timeout=10, headers=bearer(ADMIN_KEY)).json()
    except httpx.HTTPError:
        return {}
    for replica in stats.get("replicas", {}).values():
        for outcome, n in ((replica.get("engine") or {}).get("top_prefill_steps") or {}).items():
            key = f'{STEPS}{{outcome="{outcome}"}}'
            got[key] = got.get(key, 0.0) + n
    return got


@contextmanager
def _gateway(
    out: Path,
    args: argparse.Namespace,
    retention: bool,
    tag: str,
    extra: dict[str, str],
    agents_priority: str = "default",
) -> Iterator[str]:
    port = free_port()
    host = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port)]
    cmd += ["--grpc-port", str(free_port()), "--replicas", "2", "--kv-cache-bytes",
            str(args.kv_bytes), "--max-model-len", str(args.max_model_len),
            "--pin-max-share", str(args.pin_max_share),
            "--max-queued-requests", "64"]  # fmt: skip
    env = {**os.environ, "VCACHE_DATA_DIR": str(out / f"vcache-data-{tag}"),
           **_keys(agents_priority), **extra,
           "VCACHE_CACHE__RETENTION__ENABLED": "true" if retention else "false"}  # fmt: skip
    with serving(cmd, lambda: get_ok(f"{host}/readyz"), out / f"vcache-{tag}.log", env):
        yield host


def gateway_arms(out: Path, args: argparse.Namespace, retention: bool) -> list[Any]:
    rows = []
    arms = ["retention"] if retention else ["kv", "round_robin"]
    with _gateway(out, args, retention, "on" if retention else "off", {}) as host:
        for name in arms:
            extra = {} if name == "retention" else {"VCACHE_ROUTING": name}
            rows.append(arm(name, host, out, args, extra))
    return rows


def router_arm(out: Path, args: argparse.Namespace, model: str) -> Any:
    tools = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    with vllm_router(
        out, args.vllm_router, model, args.kv_bytes, args.max_model_len, tools
    ) as host:
        return arm("vllm_router", host, out, args, {})


def table(rows: list[Any]) -> str:
    head = (f"{'arm':<13}{'turns':>6}{'err':>5}{'reused':>8}{'hit':>7}"
            f"{'ttft p50':>10}{'p90':>7}{'turn-0 p50':>12}{'p90':>7}{'leased':>8}{'refused':>8}"
            f"{'preempt':>8}{'exact':>7}{'touched':>8}{'t-miss':>7}")  # fmt: skip
    lines = [head]
    for r in rows:
        later, first = r["ttft_ms_later"], r["ttft_ms_first"]
        g = r.get("gateway", {})
        leased = int(g.get(LEASED, 0))
        refused = int(g.get(REFUSED, 0))
        preempted = int(g.get(PREEMPTED, 0))
        matched = g.get('vcache_cached_token_predictions_total{outcome="matched"}', 0)
        missed = g.get('vcache_cached_token_predictions_total{outcome="missed"}', 0)
        exact = f"{matched / (matched + missed):.3f}" if matched + missed else "-"
        reused = "-" if r["reused_share"] is None else f"{r['reused_share']:.3f}"
        touch = r.get("refreshed_blocks", {})
        lines.append(
            f"{r['arm']:<13}{r['turns']:>6}{r['errors']:>5}{reused:>8}{r['hit_rate']:>7.3f}"
            f"{later['p50'] or 0:>10.0f}{later['p90'] or 0:>7.0f}{first['p50'] or 0:>12.0f}"
            f"{first['p90'] or 0:>7.0f}"
            f"{leased:>8}{refused:>8}{preempted:>8}{exact:>7}"
            f"{touch.get('touched', 0):>8.0f}{touch.get('missing', 0):>7.0f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from agent_fairness import SECOND  # it imports this module

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--vllm-router", default=None, help="the vllm-router executable")
    ap.add_argument("--agent-types", type=int, default=3)
    ap.add_argument("--system-tokens", type=int, default=1200)
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--turns", type=int, nargs=2, default=(5, 8))
    ap.add_argument("--result-tokens", type=int, nargs=2, default=(100, 300))
    ap.add_argument("--gap-median-s", type=float, default=1.0)
    ap.add_argument("--gap-max-s", type=float, default=15.0)
    ap.add_argument("--background-tokens", type=int, default=400)
    ap.add_argument("--users", type=int, default=8, help="agent sessions live at once")
    ap.add_argument("--kv-bytes", type=int, default=16 << 20, help="per replica")
    ap.add_argument("--pin-max-share", type=float, default=0.75)
    ap.add_argument("--max-model-len", type=int, default=6144)
    ap.add_argument("--limit-s", type=int, default=900)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--arms", default="retention,kv,round_robin,vllm_router")
    ap.add_argument("--fairness", action="store_true", help="the fairness runs instead")
    ap.add_argument("--max-num-seqs", type=int, default=4, help="fair slots per replica")
    ap.add_argument("--flood-users", type=int, default=4, help="background users")
    ap.add_argument(
        "--prefill-slots", type=int, default=None, help="engine.prefill_slots of default, batch"
    )
    ap.add_argument(
        "--long-prefill", type=int, default=None, help="engine.long_prefill_token_threshold"
    )
    ap.add_argument(
        "--batch", action="store_true", help="fairness: a run with the background at batch"
    )
    ap.add_argument(
        "--render", action="store_true", help="fairness: the table of the runs in --out"
    )
    ap.add_argument(
        "--second",
        choices=(*SECOND, "none"),
        default="nostop",
        help="fairness: a second gateway without prefill stops, without the guard, "
        "with the agents' prompts chunked like the others' (engine.top_prefill_whole off), "
        "without the engine's hold of lower prefills (engine.top_prefill_alone off), "
        "with the lower decodes held too (engine.top_prefill_decodes on), "
        "with the engines at niceness 10 or 0 (engine.nice; a CPU host's default: 10), "
        "or with each replica's guard on its own (engine.guard_scope: replica)",
    )
    ap.add_argument("--rounds", type=int, default=1, help="fairness: each arm's turns")
    ap.add_argument(
        "--flood-ratio", type=float, default=10.0, help="background rate / the agents' alone"
    )
    ap.add_argument(
        "--out", type=Path, default=Path("reports") / time.strftime("agents-%Y%m%d-%H%M%S")
    )
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.count = token_counter(None)
    if args.fairness:
        from agent_fairness import fairness

        return fairness(args)
    arms = set(args.arms.split(","))
    rows: list[Any] = []
    if "retention" in arms:
        rows += gateway_arms(args.out, args, retention=True)
    if arms & {"kv", "round_robin"}:
        rows += [r for r in gateway_arms(args.out, args, retention=False) if r["arm"] in arms]
    if "vllm_router" in arms and args.vllm_router:
        from gateway.core.config import Settings
        from gateway.local.build import resolve_model

        rows.append(router_arm(args.out, args, resolve_model(Settings())))
    text = table(rows)
    print(text)
    by = {r["arm"]: r for r in rows}
    checks: dict[str, bool] = {}
    if "retention" in by:
        checks["retention >= 97% of reusable tokens"] = (
            by["retention"]["reused_share"] or 0
        ) >= 0.97
    if "retention" in by and "round_robin" in by:
        rr, ret = by["round_robin"]["ttft_ms_later"]["p90"], by["retention"]["ttft_ms_later"]["p90"]
        checks["TTFT p90 >= 2x better than round_robin"] = bool(rr and ret and rr >= 2 * ret)
    for name, ok in checks.items():
        print(f"{name}: {'ok' if ok else 'MISSED'}")
    saved = {k: (list(v) if isinstance(v, tuple) else str(v) if isinstance(v, Path) else v)
             for k, v in vars(args).items() if k != "count"}  # fmt: skip
    (args.out / "agents.json").write_text(json.dumps({"args": saved, "arms": rows}, indent=2))
    (args.out / "agents.txt").write_text(text + "\n")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
