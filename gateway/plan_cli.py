"""``vcache plan``: the control loop's view of the observed provider traffic, as tables.

Reads ``GET /v1/cache/plan`` of a running gateway (an admin key when keys are
configured) and prints, per target: how skewed anchor popularity is (the Zipf
exponent), what the top anchors cover, how many anchors the rate-limit
headroom can keep warm, the break-even reuse of a dedicated warm per TTL
tier, and each anchor's decision (design note §5, ``manifest.economics``).

``vcache plan --batch-file PATH`` plans a batch before it is sent, with no gateway: an
OpenAI batch input file (JSON lines) or an Anthropic Message Batches body (a JSON
object with ``requests``), checked as the API checks it, and printed as the batch's
plan (:func:`gateway.batches.plan.preview`: send order, anchors, Zipf ``s``, top-7
coverage, predicted cost as billed and in arrival order); with ``--target
provider/model`` (repeatable, ``--rpm`` and ``--tpm`` the headroom left), the provider
plan of each: online in DAG order against the provider's batch API, and the cheaper
(:mod:`gateway.batches.provider_plan`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import httpx

from gateway.batches.intake import anthropic_plan, input_lines
from gateway.batches.plan import preview
from gateway.batches.provider_plan import Headroom, ProviderOption
from gateway.batches.targets import profile_option
from gateway.core.errors import APIError, InvalidRequest


def render(plan: dict[str, Any]) -> str:
    lines = [f"control loop: {plan.get('mode', 'off')}  counts: {plan.get('counts', {})}"]
    targets: dict[str, Any] = plan.get("targets") or {}
    if not targets:
        lines.append(plan.get("note") or "no provider traffic observed yet")
    for name, t in targets.items():
        cover = ", ".join(f"top {n}: {c:.0%}" for n, c in t["coverage_top_n"].items()) or "-"
        evens = ", ".join(f"{k}: {v}" for k, v in t["break_even_reuse"].items())
        lines += [
            "",
            f"{name}",
            f"  anchors           {t['anchors']}",
            f"  zipf exponent s   {t['zipf_s'] if t['zipf_s'] is not None else '-'}",
            f"  coverage          {cover}",
            f"  warm-set size     {t['warm_set_size'] if t['warm_set_size'] is not None else '-'}"
            f"  (anchors of {t['median_anchor_tokens']} tokens inside the headroom, one TTL)",
            f"  break-even reuse  {evens}  (reads before a dedicated warm pays)",
            f"  {'anchor':<18}{'tenant':<12}{'tokens':>8}{'per hour':>10}"
            f"{'decision':>11}{'ttl s':>8}{'beats':>7}",
        ]
        for d in t["decisions"]:
            lines.append(
                f"  {d['anchor']:<18}{d['tenant']:<12}{d['tokens']:>8}"
                f"{d['arrivals_per_hour']:>10}{d['decision']:>11}{d['ttl_s']:>8g}{d['heartbeats']:>7}"
            )
    return "\n".join(lines)


def main(url: str, api_key: str | None) -> int:
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(f"{url.rstrip('/')}/v1/cache/plan", headers=headers, timeout=10)
    except httpx.HTTPError as exc:
        print(f"vcache plan: cannot reach {url} ({exc})", file=sys.stderr)
        return 2
    if r.status_code != 200:
        print(f"vcache plan: HTTP {r.status_code}: {r.text[:300]}", file=sys.stderr)
        return 1
    print(render(r.json()))
    return 0


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def render_batch(p: dict[str, Any], shown: int = 20) -> str:
    """A batch's plan (:func:`gateway.batches.plan.preview`) as text."""
    m, cost = p["plan"], p["plan"]["predicted_cost"]
    lines = [
        f"batch plan for {p['endpoint']}",
        f"  items             {m['units']}",
        f"  prefixes          {m['prefixes']}  (distinct headers)",
        f"  anchors           {m['anchors']}  (prefixes shared by two items or more)",
        f"  zipf exponent s   {_num(m['concentration'], '.2f')}",
        f"  top-7 coverage    {_num(m['top7_coverage'], '.0%')}"
        f"  (Zipf(s) predicts {_num(m['top7_coverage_zipf'], '.0%')})",
        f"  prompt tokens     {m['prompt_tokens']}  (estimated), {m['shared_tokens']} read "
        "from a lead's prefill",
        f"  predicted cost    {cost['billed']:g} billed vs {cost['arrival_order']:g} in "
        f"arrival order (input-token equivalents, cache reads at {cost['read_mult']:g})",
        "",
        f"  {'anchor tokens':>14}{'own':>8}{'items':>8}",
    ]
    lines += [f"  {a['tokens']:>14}{a['own_tokens']:>8}{a['items']:>8}" for a in p["anchors"]]
    for t in p.get("providers") or []:
        on, off = t["online"], t["batch_api"]
        minutes = "-" if on["minutes"] is None else f"{on['minutes']:g} min"
        lines += [
            "",
            f"  {t['target']}: {t['choice']}",
            f"    online, DAG order  {on['cost']:g}  ({on['read_tokens']} read, "
            f"{on['write_tokens']} written, {minutes} in the headroom)",
            f"    batch API          {off['cost']:g}  (x{off['discount']:g}, breakpoint TTL "
            f"{off['ttl'] or '-'}, hit share {off['hit_share']:g})",
            f"    arrival order      {t['arrival_order']:g}",
        ]
    lines += ["", f"  {'#':>5}  {'custom_id':<24}{'after':<24}{'shared':>8}"]
    for n, st in enumerate(p["order"][:shown], start=1):
        lines.append(
            f"  {n:>5}  {st['custom_id']:<24}{st['after'] or '-':<24}{st['shared_tokens']:>8}"
        )
    if len(p["order"]) > shown:
        lines.append(f"  ... {len(p['order']) - shown} more")
    return "\n".join(lines)


def batch_plan(data: bytes, options: list[ProviderOption] | None = None) -> dict[str, Any]:
    """The plan of a batch file's bytes (see the module), with the provider plan of each
    of ``options``; an :class:`APIError` when the API would refuse it."""
    opts = options or []
    try:
        whole = json.loads(data)
    except ValueError:
        whole = None
    if isinstance(whole, dict) and "requests" in whole:
        return anthropic_plan(whole, lambda _: opts)
    lines = input_lines(data)
    urls = {ln.url for ln in lines}
    if len(urls) != 1:
        mixed = ", ".join(sorted(urls))
        raise InvalidRequest(f"the file mixes endpoints ({mixed}): a batch has one")
    return preview(urls.pop(), [ln.custom_id for ln in lines], [ln.body for ln in lines], opts)


def main_file(
    path: Path, targets: list[str] | None = None, rpm: float | None = None, tpm: float | None = None
) -> int:
    """``vcache plan --batch-file PATH [--target provider/model ...] [--rpm] [--tpm]``."""
    headroom = Headroom(rpm, tpm) if rpm is not None or tpm is not None else None
    try:
        options = [profile_option(t, headroom) for t in targets or []]
    except ValueError as exc:
        print(f"vcache plan: {exc}", file=sys.stderr)
        return 2
    try:
        p = batch_plan(path.read_bytes(), options)
    except OSError as exc:
        print(f"vcache plan: cannot read {path} ({exc})", file=sys.stderr)
        return 2
    except APIError as exc:
        print(f"vcache plan: {path}: {exc.message}", file=sys.stderr)
        return 1
    print(render_batch(p))
    return 0
