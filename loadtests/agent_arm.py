"""One arm of the agent-sessions benchmark: its seeded workload (agent types, sessions
of tool-calling turns, a background tenant), the gateway it runs on, its locust run
(``agents_locust.py``) and what it measured, from the users' raw rows and the gateway's
metrics before and after.  ``agent_sessions.py`` runs the routing arms on it and
``agent_fairness.py`` the fairness runs.
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

from loadtests.admin_key import api_keys_env, bearer, key_entry
from loadtests.procs import free_port, get_ok, run_locust, serving
from loadtests.report import parse_metrics, percentile, ttft_phases
from loadtests.workloads import VOCAB

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
    out: list[Any] = [
        {
            "type": "function",
            "function": {
                "name": f"run_{agent}",
                "description": f"Run step {agent} of the agent's plan",
                "parameters": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"step": {"enum": ["build", "test", "lint"]}},
                    "required": ["step"],
                },
            },
        }
    ]
    for i in range(3):
        props = {
            w: {"type": "string", "description": " ".join(rng.choices(VOCAB, k=12))}
            for w in rng.sample(VOCAB, 4)
        }
        out.append(
            {
                "type": "function",
                "function": {
                    "name": f"tool_{agent}_{i}",
                    "description": " ".join(rng.choices(VOCAB, k=20)),
                    "parameters": {"type": "object", "properties": props},
                },
            }
        )
    return out


def workload(args: argparse.Namespace, run_id: str) -> dict[str, Any]:
    rng = random.Random(args.seed)
    count = args.count
    systems = [
        f"[run {run_id}] You are agent type {a}. " + _text(rng, args.system_tokens, count)
        for a in range(args.agent_types)
    ]
    tools = {str(a): _tools(rng, a) for a in range(args.agent_types)}
    sigma = math.log(args.gap_max_s / args.gap_median_s) / 2.5  # the cap ~ 2.5 sigma out
    sessions = []
    for i in range(args.sessions):
        a = i % args.agent_types
        n = rng.randint(*args.turns)
        turns = [
            {
                "result": _text(rng, rng.randint(*args.result_tokens), count),
                "gap_s": round(
                    min(rng.lognormvariate(math.log(args.gap_median_s), sigma), args.gap_max_s), 3
                ),
            }
            for _ in range(n)
        ]
        ask = f"Task {i}: " + _text(rng, 40, count)
        sessions.append(
            {
                "id": f"{run_id}-s{i}",
                "agent": str(a),
                "system": systems[a],
                "ask": ask,
                "turns": turns,
            }
        )
    background = [_text(rng, args.background_tokens, count) for _ in range(64)]
    return {"sessions": sessions, "tools": tools, "background": background}


def raw_rows(path: Path) -> list[dict[str, str]]:
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
    env = {
        **env,
        "VCACHE_API_KEY": ADMIN_KEY,
        "VCACHE_BACKGROUND_KEY": BACKGROUND_KEY,
        "VCACHE_BACKGROUND_USERS": str(bg),
    }
    before = _metrics(host) if name != "vllm_router" else {}
    elapsed = run_locust(
        wdir / "workload.json",
        host,
        wdir,
        env,
        args.users + bg,
        args.limit_s,
        users,
        locustfile="agents_locust.py",
    )
    after = _metrics(host) if name != "vllm_router" else {}
    row = {"arm": name, "seconds": round(elapsed, 1), **summarize(raw_rows(wdir / "raw.csv"))}
    if after:
        row["gateway"] = {
            k: after.get(k, 0) - before.get(k, 0)
            for k in (
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
            )
        }
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
    return {
        "stalls": stalls,
        "gc_ms": 1000 * _added(before, after, gc),
        "gc2_ms": 1000 * _added(before, after, gc, 'generation="2"'),
    }


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
def agents_gateway(
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
    cmd += [
        "--grpc-port",
        str(free_port()),
        "--replicas",
        "2",
        "--kv-cache-bytes",
        str(args.kv_bytes),
        "--max-model-len",
        str(args.max_model_len),
        "--pin-max-share",
        str(args.pin_max_share),
        "--max-queued-requests",
        "64",
    ]
    env = {
        **os.environ,
        "VCACHE_DATA_DIR": str(out / f"vcache-data-{tag}"),
        **_keys(agents_priority),
        **extra,
        "VCACHE_CACHE__RETENTION__ENABLED": "true" if retention else "false",
    }
    with serving(cmd, lambda: get_ok(f"{host}/readyz"), out / f"vcache-{tag}.log", env):
        yield host
