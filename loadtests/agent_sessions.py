"""Agent sessions under KV pressure: retention and affinity against plain KV routing,
round robin and vllm-router.

    .venv/bin/python -m loadtests.agent_sessions [--vllm-router PATH]

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
import json
import sys
import time
from pathlib import Path
from typing import Any

from loadtests.agent_arm import LEASED, PREEMPTED, REFUSED, agents_gateway, arm
from loadtests.agent_fairness import SECOND, fairness
from loadtests.procs import vllm_router
from loadtests.run import token_counter


def gateway_arms(out: Path, args: argparse.Namespace, retention: bool) -> list[Any]:
    rows = []
    arms = ["retention"] if retention else ["kv", "round_robin"]
    with agents_gateway(out, args, retention, "on" if retention else "off", {}) as host:
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
    head = (
        f"{'arm':<13}{'turns':>6}{'err':>5}{'reused':>8}{'hit':>7}"
        f"{'ttft p50':>10}{'p90':>7}{'turn-0 p50':>12}{'p90':>7}{'leased':>8}{'refused':>8}"
        f"{'preempt':>8}{'exact':>7}{'touched':>8}{'t-miss':>7}"
    )
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
    saved = {
        k: (list(v) if isinstance(v, tuple) else str(v) if isinstance(v, Path) else v)
        for k, v in vars(args).items()
        if k != "count"
    }
    (args.out / "agents.json").write_text(json.dumps({"args": saved, "arms": rows}, indent=2))
    (args.out / "agents.txt").write_text(text + "\n")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
