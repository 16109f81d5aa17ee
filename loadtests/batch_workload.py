"""The held-out batch workload (issue 52) on the provider emulator: what ordering a batch
by its prefix DAG buys, against arrival order and against the provider's batch API.

``python -m loadtests.batch_workload [--units 10000] [--anchors 1000] [--out PATH]``

The workload: ``units`` work units of 10-50 tokens, each under one of ``anchors``
anchors (a system prompt of 1-4k tokens), the anchor drawn from Zipf(s) over the
anchors, for s = 0.8, 1.0 and 1.74; the units arrive in random order.  On each
provider (Anthropic, with a breakpoint on the anchor; OpenAI, automatic caching) three
arms send the same requests to the emulator (in process, over its HTTP API):

- **dag**: online, in the order of the batch's prefix DAG as vcache's batch runner
  walks it (:func:`gateway.batches.plan.units`, :meth:`PrefixDag.order`): an anchor's
  units back to back;
- **arrival**: online, in arrival order;
- **batch_api**: the provider's batch API given the units in arrival order (no
  ordering): items in waves of ``--parallel`` that do not read each other's writes,
  each wave taking ``--wave-s`` emulator seconds; billed at half price;
- **batch_api_dag**: the same batch API given the units in DAG order;
- **batch_api_leads**: the same batch API given the units leads first, then the rest in
  DAG order (:func:`gateway.batches.plan.leads_first`: what vcache submits when the
  provider plan chooses the batch API).

The batch arms' requests use the short cache tier, or with ``--batch-ttl 1h`` the long
one (Anthropic's 1-hour breakpoint, written at 2.0; OpenAI's 24 h retention): a batch's
items are spread over its whole run, longer than 5 minutes.

Online requests are paced at what the rate-limit headroom allows (design note §5.5:
``min(R, X/P̄)`` requests a minute, ``--rpm`` and ``--tpm``), the emulator's clock
moved on by that pace between requests, so an anchor whose units are spread out expires
between them (5 minutes: Anthropic's short TTL, OpenAI's in-memory retention).  Billed
cost is in input-token equivalents at the online price (uncached 1, cache read ``r``,
cache write ``w``: Anthropic r 0.1, 5m write 1.25; OpenAI r 0.5, writes free, as
``manifest.planner``'s profiles have them); output tokens, one per request, are left
out.  Beside each measured cost, the provider plan's prediction
(:mod:`gateway.batches.provider_plan`) of the dag arm and of its batch option (DAG
order, the breakpoint TTL it picks, its stated hit share), and each arm's read share;
and the plan's batch estimate before and after calibration: the hit share the
leads-first batch measured (:func:`gateway.batches.provider_plan.measure`, of the kind that
arm ran under: ``--batch-ttl`` on Anthropic, implicit on OpenAI) moving the prior as a
gateway's store would after that batch, against that arm's measured cost.
Top-7 coverage is measured (the share of units under the 7 most used anchors) against
H(7,s)/H(V,s).

Prints a table and writes the figures as JSON to ``--out``.  The local-replica arm (a
vLLM engine) is :mod:`loadtests.batch_local`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from gateway.batches.plan import leads_first
from gateway.batches.plan import units as plan_units
from gateway.batches.provider_plan import ProviderOption, belief, compare, measure
from gateway.batches.targets import profile_option
from loadtests.emulator.app import create_app
from loadtests.emulator.batch_book import BATCH_DISCOUNT, BatchBook, BatchRules
from loadtests.emulator.state import EmulatorState
from manifest.economics import zipf_coverage
from manifest.prefix_dag import PrefixDag

KEY = "workload-key"
MODELS = {"anthropic": "claude-sonnet-4-5", "openai": "gpt-5"}
PRICES = {  # read, 5m write, 1h write (input-token equivalents)
    "anthropic": (0.1, 1.25, 2.0),
    "openai": (0.5, 1.0, 1.0),
}
WORDS = "cache prefix token block warm anchor replica model stream byte ledger plan".split()


def filler(rng: random.Random, tokens: int) -> str:
    """About ``tokens`` of the emulator's tokens (4 bytes each)."""
    out: list[str] = []
    size = 0
    while size < tokens * 4:
        w = rng.choice(WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)


def workload(
    units: int,
    anchors: int,
    s: float,
    seed: int,
    anchor_tokens: tuple[int, int] = (1000, 4000),
    unit_tokens: tuple[int, int] = (10, 50),
) -> tuple[list[str], list[int], list[str]]:
    """The anchors' texts, each unit's anchor (arrival order) and each unit's own text."""
    rng = random.Random(seed)
    texts = [f"anchor {j}: " + filler(rng, rng.randint(*anchor_tokens)) for j in range(anchors)]
    weights = [(j + 1) ** -s for j in range(anchors)]
    which = rng.choices(range(anchors), weights=weights, k=units)
    own = [f"unit {i}: " + filler(rng, rng.randint(*unit_tokens)) for i in range(units)]
    return texts, which, own


def body(provider: str, anchor: str, text: str, ttl: str = "5m") -> dict[str, Any]:
    """One unit's request; ``ttl`` ``1h``: Anthropic's 1-hour breakpoint, OpenAI's 24 h
    retention (the long tier of each)."""
    if provider == "anthropic":
        mark = {"type": "ephemeral", **({"ttl": "1h"} if ttl == "1h" else {})}
        system = [{"type": "text", "text": anchor, "cache_control": mark}]
        return {
            "model": MODELS[provider],
            "max_tokens": 1,
            "system": system,
            "messages": [{"role": "user", "content": text}],
        }
    out: dict[str, Any] = {
        "model": MODELS[provider],
        "max_tokens": 1,
        "messages": [{"role": "system", "content": anchor}, {"role": "user", "content": text}],
    }
    if ttl == "1h":
        out["prompt_cache_retention"] = "24h"
    return out


def cost(provider: str, bill: dict[str, Any], discount: float = 1.0) -> float:
    r, w5, w1 = PRICES[provider]
    tokens = [float(bill[k]) for k in ("uncached", "read", "write", "write_long")]
    return discount * (tokens[0] + r * tokens[1] + w5 * tokens[2] + w1 * tokens[3])


def headers(provider: str) -> dict[str, str]:
    if provider == "anthropic":
        return {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    return {"authorization": f"Bearer {KEY}"}


async def online(
    provider: str, bodies: list[dict[str, Any]], order: list[int], pace_s: float
) -> dict[str, Any]:
    """Send ``bodies`` in ``order``, one at a time, the emulator's clock moved on by
    ``pace_s`` before each; the bill."""
    state = EmulatorState(api_key=KEY, answer_words=1)
    app = create_app(state)
    path = "/v1/messages" if provider == "anthropic" else "/v1/chat/completions"
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://emulator"
    ) as http:
        for i in order:
            state.clock.advance(pace_s)
            r = await http.post(path, json=bodies[i], headers=headers(provider))
            r.raise_for_status()
    return state.bill(provider).view()


async def batch_api(
    provider: str, bodies: list[dict[str, Any]], parallel: int, wave_s: float
) -> tuple[dict[str, Any], list[tuple[int, int]]]:
    """The bodies, in the order given, through the provider's batch API; the bill and each
    item's prompt and cached tokens as answered (in that order)."""
    rules = BatchRules(delay_s=0.0, parallel=parallel, wave_s=wave_s)
    state = EmulatorState(api_key=KEY, answer_words=1, batch_book=BatchBook(rules))
    app = create_app(state)
    h = headers(provider)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://emulator", timeout=600
    ) as http:
        if provider == "anthropic":
            reqs = [{"custom_id": f"u{i}", "params": b} for i, b in enumerate(bodies)]
            r = await http.post("/v1/messages/batches", json={"requests": reqs}, headers=h)
            r.raise_for_status()
            done = await http.get(f"/v1/messages/batches/{r.json()['id']}", headers=h)
            assert done.json()["processing_status"] == "ended", done.text
            got = await http.get(done.json()["results_url"], headers=h)
            answers = {
                x["custom_id"]: x["result"].get("message") or {}
                for x in map(json.loads, got.text.splitlines())
            }
        else:
            lines = [
                {"custom_id": f"u{i}", "method": "POST", "url": "/v1/chat/completions", "body": b}
                for i, b in enumerate(bodies)
            ]
            data = b"".join(json.dumps(ln).encode() + b"\n" for ln in lines)
            f = await http.post(
                "/v1/files",
                files={"file": ("in.jsonl", data)},
                data={"purpose": "batch"},
                headers=h,
            )
            f.raise_for_status()
            spec = {
                "input_file_id": f.json()["id"],
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            }
            r = await http.post("/v1/batches", json=spec, headers=h)
            r.raise_for_status()
            done = await http.get(f"/v1/batches/{r.json()['id']}", headers=h)
            assert done.json()["status"] == "completed", done.text
            got = await http.get(f"/v1/files/{done.json()['output_file_id']}/content", headers=h)
            answers = {
                x["custom_id"]: x["response"]["body"]
                for x in map(json.loads, got.text.splitlines())
            }
    usage = [prompt_tokens(answers.get(f"u{i}") or {}) for i in range(len(bodies))]
    return state.bill(f"{provider}-batch").view(), usage


def prompt_tokens(answer: dict[str, Any]) -> tuple[int, int]:
    """An answer's prompt tokens (cached included) and cached tokens, in its API's terms."""
    u = answer.get("usage") or {}
    if "prompt_tokens" in u:  # a chat completion
        cached = int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        return int(u["prompt_tokens"]), cached
    read = int(u.get("cache_read_input_tokens") or 0)  # a Message
    written = int(u.get("cache_creation_input_tokens") or 0)
    return int(u.get("input_tokens") or 0) + read + written, read


def read_share(bill: dict[str, Any]) -> float:
    """The share of the prompt tokens read from cache."""
    total = sum(float(bill[k]) for k in ("uncached", "read", "write", "write_long"))
    return round(float(bill["read"]) / total, 4) if total else 0.0


def pace(rpm: float, tpm: float, bodies: list[dict[str, Any]]) -> float:
    """Seconds between online requests inside the headroom: 60 / min(R, X/P̄)."""
    mean = sum(len(json.dumps(b)) / 4 for b in bodies) / max(1, len(bodies))
    return 60.0 / min(rpm, tpm / max(mean, 1.0))


async def run_s(args: argparse.Namespace, s: float) -> dict[str, Any]:
    texts, which, own = workload(args.units, args.anchors, s, args.seed)
    counts = Counter(which)
    top7 = sum(c for _, c in counts.most_common(7)) / len(which)
    out: dict[str, Any] = {
        "s": s,
        "units": args.units,
        "anchors": args.anchors,
        "anchors_used": len(counts),
        "top7_coverage": round(top7, 4),
        "top7_coverage_zipf": round(zipf_coverage(7, args.anchors, s), 4),
        "providers": {},
    }
    for provider in args.providers:
        bodies = [body(provider, texts[a], own[i]) for i, a in enumerate(which)]
        # the batch arms' requests: the long cache tier with --batch-ttl 1h
        sent = [body(provider, texts[a], own[i], args.batch_ttl) for i, a in enumerate(which)]
        endpoint = "/v1/messages" if provider == "anthropic" else "/v1/chat/completions"
        us = plan_units(endpoint, bodies)
        dag = PrefixDag(us)
        steps = dag.order()
        order = [int(st.unit) for st in steps]
        leads = [int(st.unit) for st in leads_first(steps)]
        arrival = list(range(len(bodies)))
        gap = pace(args.rpm, args.tpm, bodies)
        t0 = time.perf_counter()
        leads_bill, leads_usage = await batch_api(
            provider, [sent[i] for i in leads], args.parallel, args.wave_s
        )
        bills = {
            "dag": await online(provider, bodies, order, gap),
            "arrival": await online(provider, bodies, arrival, gap),
            "batch_api": (await batch_api(provider, sent, args.parallel, args.wave_s))[0],
            "batch_api_dag": (
                await batch_api(provider, [sent[i] for i in order], args.parallel, args.wave_s)
            )[0],
            "batch_api_leads": leads_bill,
        }
        costs = {
            "dag": cost(provider, bills["dag"]),
            "arrival": cost(provider, bills["arrival"]),
            "batch_api": cost(provider, bills["batch_api"], BATCH_DISCOUNT),
            "batch_api_dag": cost(provider, bills["batch_api_dag"], BATCH_DISCOUNT),
            "batch_api_leads": cost(provider, bills["batch_api_leads"], BATCH_DISCOUNT),
        }
        option: ProviderOption = profile_option(f"{provider}/{MODELS[provider]}")
        plan = compare(option, us, steps)
        # calibrated: the hit share the leads-first batch (what vcache submits) measured,
        # moving the prior of the kind that arm ran under, as a gateway would after it
        kind = "implicit" if provider == "openai" else args.batch_ttl
        by_unit = {int(st.unit): st for st in steps}
        samples = [
            (by_unit[i].shared_tokens if by_unit[i].after is not None else 0, us[i].size, *u)
            for i, u in zip(leads, leads_usage, strict=True)
        ]
        hits, reads = measure(option, samples)
        shares = dict(option.hit_share)
        shares[kind] = belief(shares[kind], hits, reads)
        calibrated = compare(dataclasses.replace(option, hit_share=shares), us, steps)
        out["providers"][provider] = {
            "pace_s": round(gap, 3),
            "measured_s": round(dag.concentration() or 0.0, 3),
            "bills": bills,
            "cost": {k: round(v, 1) for k, v in costs.items()},
            "read_share": {k: read_share(b) for k, b in bills.items()},
            "predicted": {
                "dag": plan["online"]["cost"],
                "batch_api": plan["batch_api"]["cost"],
                "arrival": plan["arrival_order"],
                "choice": plan["choice"],
                "ttl": plan["batch_api"]["ttl"],
                "hit_share": plan["batch_api"]["hit_share"],
            },
            "measured_hit_share": {
                "kind": kind,
                "hits": round(hits, 1),
                "reads": reads,
                "share": round(hits / reads, 4) if reads else None,
            },
            "calibrated": {
                "batch_api": calibrated["batch_api"]["cost"],
                "choice": calibrated["choice"],
                "ttl": calibrated["batch_api"]["ttl"],
                "hit_share": calibrated["batch_api"]["hit_share"],
            },
            "wall_s": round(time.perf_counter() - t0, 1),
        }
    return out


def table(results: list[dict[str, Any]]) -> str:
    head = (
        f"{'s':>5} {'provider':<10}{'dag':>12}{'arrival':>12}{'batch_api':>12}"
        f"{'batch dag':>12}{'batch leads':>12}{'dag/arr':>8}{'pred dag':>12}{'pred batch':>12}"
        f"  {'top7':>6}{'H(7,s)/H(V,s)':>14}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        for p, v in r["providers"].items():
            c, pr = v["cost"], v["predicted"]
            lines.append(
                f"{r['s']:>5} {p:<10}{c['dag']:>12,.0f}{c['arrival']:>12,.0f}"
                f"{c['batch_api']:>12,.0f}{c['batch_api_dag']:>12,.0f}"
                f"{c['batch_api_leads']:>12,.0f}"
                f"{c['dag'] / c['arrival']:>8.3f}{pr['dag']:>12,.0f}{pr['batch_api']:>12,.0f}"
                f"  {r['top7_coverage']:>6.1%}{r['top7_coverage_zipf']:>14.1%}"
            )
    lines += [
        "",
        "the plan's batch-API estimate: prior hit share against calibrated on the leads-first"
        " batch (measured), beside that arm's measured cost",
        f"{'s':>5} {'provider':<10}{'h prior':>8}{'pred':>12}{'choice':>10}{'h meas':>8}"
        f"{'h cal':>8}{'pred cal':>12}{'choice':>10}{'measured':>12}{'pred/meas':>10}"
        f"{'cal/meas':>9}",
    ]
    for r in results:
        for p, v in r["providers"].items():
            pr, cal, m = v["predicted"], v["calibrated"], v["measured_hit_share"]
            meas = v["cost"]["batch_api_leads"]
            lines.append(
                f"{r['s']:>5} {p:<10}{pr['hit_share']:>8.3f}{pr['batch_api']:>12,.0f}"
                f"{pr['choice']:>10}{(m['share'] or 0):>8.3f}{cal['hit_share']:>8.3f}"
                f"{cal['batch_api']:>12,.0f}{cal['choice']:>10}{meas:>12,.0f}"
                f"{pr['batch_api'] / meas:>10.2f}{cal['batch_api'] / meas:>9.2f}"
            )
    lines += ["", "read share (cache reads / prompt tokens) per arm"]
    for r in results:
        for p, v in r["providers"].items():
            shares = "  ".join(f"{k} {x:.3f}" for k, x in v["read_share"].items())
            lines.append(f"{r['s']:>5} {p:<10}{shares}")
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    return [await run_s(args, s) for s in args.s]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--units", type=int, default=10_000)
    p.add_argument("--anchors", type=int, default=1_000)
    p.add_argument("--s", type=float, nargs="+", default=[0.8, 1.0, 1.74])
    p.add_argument("--providers", nargs="+", default=["anthropic", "openai"])
    p.add_argument("--rpm", type=float, default=2000.0, help="requests/min of headroom")
    p.add_argument("--tpm", type=float, default=200_000.0, help="input tokens/min of headroom")
    p.add_argument("--parallel", type=int, default=16, help="batch API: items per wave")
    p.add_argument("--wave-s", type=float, default=2.0, help="batch API: seconds per wave")
    p.add_argument(
        "--batch-ttl",
        choices=["5m", "1h"],
        default="5m",
        help="the batch arms' cache tier: Anthropic's breakpoint TTL (1h: 2.0 writes), "
        "OpenAI's retention (1h: 24h)",
    )
    p.add_argument("--seed", type=int, default=52)
    p.add_argument("--out", type=Path, default=Path("batch_workload.json"))
    args = p.parse_args(argv)
    results = asyncio.run(main_async(args))
    print(table(results))
    args.out.write_text(
        json.dumps(
            {"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=1
        )
    )
    print(f"\nwritten: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
