"""The fairness runs of the agent workload (``python -m loadtests.agent_sessions --fairness``).

The agents (their key's requests interactive) alone, then beside a background
tenant (default priority; ``--batch``: at batch priority too) at
``--flood-ratio`` times their request rate, then (``--second``) the flood on a
second gateway with one setting changed.  Fair slots (``engine.max_num_seqs``)
in every run.

With ``--rounds N`` every arm runs N times, taking turns in an order reversed
every round (the first round starts alone: the flood's rate is 10 times what
it measured), both gateways up throughout, so the drift of a shared machine
falls on every arm alike.  Each round is its own row (``alone.2``); the
targets are judged on the rounds pooled: every later turn of an arm's rounds
in one percentile, and the per-token fit over all of them.
"""

from __future__ import annotations

import argparse
import json
import statistics
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from loadtests.agent_arm import LEASE_ROOM, REFUSED, agents_gateway, arm, raw_rows
from loadtests.report import percentile, phases_table

# --second: the flood on a gateway with this setting changed
SECOND = {
    "noguard": {"VCACHE_ENGINE__FIRST_TOKEN_GUARD": "false"},  # the guard and its stops off
    "nostop": {"VCACHE_ENGINE__PREEMPT_PREFILLS": "false"},  # the guard on, the stops off
    "chunked": {"VCACHE_ENGINE__TOP_PREFILL_WHOLE": "false"},  # agents chunked like others
    "nohold": {"VCACHE_ENGINE__TOP_PREFILL_ALONE": "false"},  # lower prefills not held
    "decodes": {"VCACHE_ENGINE__TOP_PREFILL_DECODES": "true"},  # lower decodes held too
    "nice": {"VCACHE_ENGINE__NICE": "10"},  # the engines' CPU priority below the gateway's
    "nonice": {"VCACHE_ENGINE__NICE": "0"},  # ... level with it (a CPU host's default: 10)
    "replica": {"VCACHE_ENGINE__GUARD_SCOPE": "replica"},  # each replica's guard alone
}


def base(name: str) -> str:
    """The arm a round's row belongs to (``alone.2`` -> ``alone``)."""
    return name.split(".")[0]


def fairness_arms(out: Path, args: argparse.Namespace) -> list[Any]:
    """Every arm's rows, round by round (see the module)."""
    slots = {"VCACHE_ENGINE__MAX_NUM_SEQS": str(args.max_num_seqs)}
    if args.long_prefill:
        slots["VCACHE_ENGINE__LONG_PREFILL_TOKEN_THRESHOLD"] = str(args.long_prefill)
    if args.prefill_slots:
        n = args.prefill_slots
        slots["VCACHE_ENGINE__PREFILL_SLOTS"] = json.dumps({"default": n, "batch": n})
    rows: list[Any] = []
    with ExitStack() as stack:
        host = stack.enter_context(agents_gateway(out, args, True, "guard", slots, "interactive"))
        second = None
        if args.second in SECOND:
            extra = {**slots, **SECOND[args.second]}
            second = stack.enter_context(
                agents_gateway(out, args, True, args.second, extra, "interactive")
            )
        flood: dict[str, str] = {}
        for name in order(args.rounds, args.batch, args.second if second else None):
            if base(name) == "alone":
                rows.append(arm(name, host, out, args, {"VCACHE_BACKGROUND_USERS": "0"}))
                flood = flood or _flood(args, rates(out, name)["agents_rps"])
                continue
            env = {**flood, "VCACHE_BACKGROUND_PRIORITY": "batch"} if "batch" in name else flood
            target = host if base(name) in ("flooded_guard", "flooded_batch") else second
            assert target is not None
            rows.append(arm(name, target, out, args, env))
    return rows


def order(rounds: int, batch: bool, second: str | None) -> list[str]:
    """The runs in the order they take turns: ``alone`` first (the flood's rate is
    measured there), each round reversed from the one before; ``.n`` names the round
    when there are several."""
    names = ["alone", "flooded_guard"] + (["flooded_batch"] if batch else [])
    names += [f"flooded_{second}"] if second else []
    runs = []
    for i in range(rounds):
        tag = f".{i + 1}" if rounds > 1 else ""
        runs += [n + tag for n in (names if i % 2 == 0 else names[::-1])]
    return runs


def _flood(args: argparse.Namespace, agents_rps: float) -> dict[str, str]:
    rate = args.flood_ratio * agents_rps
    return {
        "VCACHE_BACKGROUND_USERS": str(args.flood_users),
        "VCACHE_BACKGROUND_RPS": f"{rate / args.flood_users:.4f}",
    }


def rates(out: Path, name: str) -> dict[str, float]:
    """Requests per second of the agents and of the background tenant in one run."""
    rows = raw_rows(out / name / "raw.csv")
    span = max((float(r["t"]) for r in rows), default=0.0) or 1.0
    agents = sum(r["kind"] == "agent" for r in rows)
    return {"agents_rps": agents / span, "background_rps": (len(rows) - agents) / span}


def _later(out: Path, names: list[str]) -> list[dict[str, str]]:
    """The agents' answered later turns of these runs."""
    return [
        r
        for n in names
        for r in raw_rows(out / n / "raw.csv")
        if r["kind"] == "agent" and r["ok"] == "1" and int(r["turn"]) > 0
    ]


def prefill_fit(out: Path, names: list[str]) -> dict[str, float] | None:
    """TTFT of the agents' later turns against the prompt tokens each computed:
    ``ms_per_token``, what vLLM takes per uncached token, and ``wait_ms``, what comes on
    top whatever the prompt (a step already running, a queue).  Theil-Sen (the median
    of the pairwise slopes): one turn that waited behind a preemption tilts a least
    squares line over 40 turns (a round fitted 0.66 ms a token and -121 ms of wait),
    not this one."""
    later = _later(out, names)
    return theil_sen(
        [int(r["prompt_tokens"]) - int(r["cached_tokens"]) for r in later],
        [float(r["ttft_ms"]) for r in later],
    )


def theil_sen(xs: list[int], ys: list[float]) -> dict[str, float] | None:
    """The line through ``(xs, ys)`` by the median pairwise slope and the median
    intercept; None where no two points differ in x."""
    pts = list(zip(xs, ys, strict=True))
    slopes = [
        (y2 - y1) / (x2 - x1)
        for i, (x1, y1) in enumerate(pts)
        for x2, y2 in pts[i + 1 :]
        if x2 != x1
    ]
    if not slopes:
        return None
    slope = statistics.median(slopes)
    return {"ms_per_token": slope, "wait_ms": statistics.median(y - slope * x for x, y in pts)}


def pooled(out: Path, rows: list[Any]) -> dict[str, dict[str, Any]]:
    """Per arm, its rounds' later turns in one: turns, TTFT p50 / p90, the fit."""
    arms: dict[str, list[str]] = {}
    for r in rows:
        arms.setdefault(base(r["arm"]), []).append(r["arm"])
    got = {}
    for name, runs in arms.items():
        ttft = [float(r["ttft_ms"]) for r in _later(out, runs)]
        got[name] = {
            "rounds": len(runs),
            "turns": len(ttft),
            "p50": percentile(ttft, 50),
            "p90": percentile(ttft, 90),
            "fit": prefill_fit(out, runs),
        }
    return got


def fairness_table(
    rows: list[Any], pool: dict[str, dict[str, Any]], chunk: int | None
) -> tuple[str, bool]:
    """The runs' table, the arms pooled over their rounds, and lines on what the flood
    added; whether the 20% target held (pooled)."""
    lines = [
        f"{'run':<18}{'agent rps':>10}{'bg rps':>8}{'err':>5}{'ttft p50':>10}{'p90':>7}"
        f"{'turn-0 p90':>12}{'reused':>8}{'refused':>8}{'placed':>8}{'stops':>7}"
        f"{'ms/tok':>8}{'wait ms':>9}{'held':>6}{'unfit':>6}{'stalls':>7}{'gc ms':>7}{'gc2':>5}"
    ]
    for r in rows:
        later, first, g = r["ttft_ms_later"], r["ttft_ms_first"], r.get("gateway", {})
        fit = r.get("fit") or {"ms_per_token": 0.0, "wait_ms": 0.0}
        reused = "-" if r["reused_share"] is None else f"{r['reused_share']:.3f}"
        lines.append(
            f"{r['arm']:<18}{r['agents_rps']:>10.2f}{r['background_rps']:>8.2f}"
            f"{r['errors']:>5}{later['p50'] or 0:>10.0f}{later['p90'] or 0:>7.0f}"
            f"{first['p90'] or 0:>12.0f}{reused:>8}{int(g.get(REFUSED, 0)):>8}"
            f"{int(g.get(LEASE_ROOM, 0)):>8}{int(r.get('prefill_stops') or 0):>7}"
            f"{fit['ms_per_token']:>8.2f}{fit['wait_ms']:>9.0f}"
            f"{_steps(r, 'held')}{_steps(r, 'unfit')}{_loop(r)}"
        )
    lines += [
        "",
        f"{'pooled':<18}{'rounds':>7}{'turns':>7}{'ttft p50':>10}{'p90':>7}"
        f"{'ms/tok':>8}{'wait ms':>9}",
    ]
    for name, p in pool.items():
        fit = p["fit"] or {"ms_per_token": 0.0, "wait_ms": 0.0}
        lines.append(
            f"{name:<18}{p['rounds']:>7}{p['turns']:>7}{p['p50'] or 0:>10.0f}"
            f"{p['p90'] or 0:>7.0f}{fit['ms_per_token']:>8.2f}"
            f"{fit['wait_ms']:>9.0f}"
        )
    alone, guarded = pool["alone"]["p90"], pool["flooded_guard"]["p90"]
    ok = bool(alone and guarded and guarded <= 1.2 * alone)
    ratio = f"{guarded / alone:.2f}x" if alone and guarded else "-"
    verdict = "ok" if ok else "MISSED"
    lines.append(f"flooded p90 within 20% of alone (guard on): {verdict} ({ratio})")
    fit = pool["alone"]["fit"]
    step = fit["ms_per_token"] * chunk if fit and chunk else None
    for name in pool:  # what each flood adds to a first token
        if name == "alone":
            continue
        for q in ("p50", "p90"):
            added = (pool[name][q] or 0) - (pool["alone"][q] or 0)
            steps = f" = {added / step:.2f} steps of {chunk} tokens ({step:.0f} ms)" if step else ""
            lines.append(f"{name} adds {added:.0f} ms to the later turns' TTFT {q}{steps}")
    return "\n".join(lines), ok


def _steps(row: Any, outcome: str) -> str:
    """The engine steps the top-prefill patch changed in a run, by outcome (runs made
    before it counted them: -)."""
    n = (row.get("engine_steps") or {}).get(outcome)
    return f"{'-':>6}" if n is None else f"{n:>6.0f}"


def _loop(row: Any) -> str:
    """The gateway's event-loop stalls and garbage-collection time in a run, all and of
    the oldest generation (runs made before the gateway measured them: -)."""
    loop = row.get("loop")
    if loop is None:
        return f"{'-':>7}{'-':>7}{'-':>5}"
    gc2 = loop.get("gc2_ms")
    return f"{loop['stalls']:>7.0f}{loop['gc_ms']:>7.0f}" + (
        f"{'-':>5}" if gc2 is None else f"{gc2:>5.0f}"
    )


def fairness(args: argparse.Namespace) -> int:
    """The fairness runs (or, with ``--render``, the table of runs already in ``--out``)."""
    path = args.out / "fairness.json"
    rows = json.loads(path.read_text()) if args.render else fairness_arms(args.out, args)
    for r in rows:
        r.update(rates(args.out, r["arm"]))
        r["fit"] = prefill_fit(args.out, [r["arm"]])
    text, ok = fairness_table(rows, pooled(args.out, rows), args.long_prefill)
    if failed := [r["arm"] for r in rows if not r["turns"]]:
        text += f"\nno turn answered in {', '.join(failed)}: see the gateway's log in {args.out}"
        ok = False
    text += "\n\nthe agents' TTFT in the gateway by phase, ms mean / p90 (every turn):\n"
    text += phases_table(rows)
    print(text)
    path.write_text(json.dumps(rows, indent=2))
    (args.out / "fairness.txt").write_text(text + "\n")
    return 0 if ok else 1
