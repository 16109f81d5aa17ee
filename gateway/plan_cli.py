"""``vcache plan``: the control loop's view of the observed provider traffic, as tables.

Reads ``GET /v1/cache/plan`` of a running gateway (an admin key when keys are
configured) and prints, per target: how skewed anchor popularity is (the Zipf
exponent), what the top anchors cover, how many anchors the rate-limit
headroom can keep warm, the break-even reuse of a dedicated warm per TTL
tier, and each anchor's decision (design note §5, ``manifest.economics``).
"""

from __future__ import annotations

import sys
from typing import Any

import httpx


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
