"""A batch's items as the prefix DAG's units, and what the DAG measures of them.

Each item's request body is cut into segments the way the session log splits a
request (:func:`gateway.sessions.render.request_parts`: a header of what frames it,
then its turns), read off the JSON as sent so it is cheap and the same for every
target: the header (model, system prompt or instructions, tools) is one segment,
then each message (each input item of a Responses request; a completion's prompt).
A segment is named by the digest of its canonical JSON and sized at one token per
four bytes of it, an estimate that only orders anchors.

:func:`units` are a batch's items as the DAG's units (unit ids are the items'
indexes) and :func:`measures` what is reported on the batch: the units, the anchors, the tokens
the send order lets units read from cache, the measured Zipf skew ``s`` of the
top-level prefixes and the share of items under the top 7 of them (shared/seeds/001,
§5.2), beside what Zipf(s) predicts for that share, and the predicted cost as billed
and in arrival order (:mod:`gateway.batches.cost`).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Sequence
from typing import Any

from gateway.batches.cost import predicted
from gateway.batches.provider_plan import ProviderOption, compare
from manifest.economics import zipf_coverage
from manifest.prefix_dag import PrefixDag, Step, Unit

TOP = 7  # the design note's "7 → 85%"
SYSTEM_ROLES = ("system", "developer")


def _segment(value: Any) -> tuple[str, int]:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    digest = hashlib.sha256(text.encode()).hexdigest()[:32]
    return digest, max(1, len(text.encode()) // 4)


def segments(endpoint: str, body: dict[str, Any]) -> list[tuple[str, int]]:
    """The segments of one request body of ``endpoint`` (see the module)."""
    turns: list[Any]
    if endpoint == "/v1/completions":
        header: dict[str, Any] = {"model": body.get("model")}
        turns = [body.get("prompt")]
    elif endpoint == "/v1/responses":
        header = {k: body.get(k) for k in ("model", "instructions", "tools")}
        items = body.get("input")
        turns = items if isinstance(items, list) else [items]
    else:  # chat completions, Anthropic messages
        messages = body.get("messages")
        messages = messages if isinstance(messages, list) else [messages]
        system = [m for m in messages if isinstance(m, dict) and m.get("role") in SYSTEM_ROLES]
        turns = [m for m in messages if not (isinstance(m, dict) and m.get("role") in SYSTEM_ROLES)]
        header = {
            "model": body.get("model"),
            "system": body.get("system", system),
            "tools": body.get("tools"),
        }
    return [_segment(header), *(_segment(t) for t in turns)]


def units(endpoint: str, bodies: Sequence[dict[str, Any]]) -> list[Unit]:
    """A batch's item bodies as the DAG's units; unit ``str(i)`` is item ``i``."""
    out = []
    for i, body in enumerate(bodies):
        segs = segments(endpoint, body)
        out.append(Unit(str(i), tuple(d for d, _ in segs), tuple(n for _, n in segs)))
    return out


def measures(dag: PrefixDag, units: Sequence[Unit]) -> dict[str, Any]:
    """What the batch object reports of the DAG of ``units`` (see the module)."""
    steps = dag.order()
    roots = Counter(u.blocks[0] for u in units if u.blocks)
    n = sum(roots.values())
    s = dag.concentration()
    top = sum(c for _, c in roots.most_common(TOP))
    return {
        "units": len(steps),
        "anchors": len(dag.anchors()),
        "prefixes": len(roots),
        "prompt_tokens": sum(u.size for u in units),
        "shared_tokens": sum(st.shared_tokens for st in steps),
        "concentration": s,
        "top7_coverage": top / n if n else None,
        "top7_coverage_zipf": (
            zipf_coverage(min(TOP, len(roots)), len(roots), s) if s is not None else None
        ),
        "predicted_cost": predicted(units, steps),
    }


def leads_first(steps: Sequence[Step]) -> list[Step]:
    """``steps`` for an executor that runs many items side by side and cannot wait for a
    lead (a provider's batch API): the items that wait for nothing first, then the rest,
    each part in DAG order.  In DAG order an anchor's siblings sit together, so a wave
    run side by side holds many of them before any has written the prefix: they all
    miss.  Leads first, the prefixes are written by the early waves and read by the
    later ones."""
    return [st for st in steps if st.after is None] + [st for st in steps if st.after is not None]


ANCHORS_SHOWN = 10


def preview(
    endpoint: str,
    custom_ids: Sequence[str],
    bodies: Sequence[dict[str, Any]],
    options: Sequence[ProviderOption] = (),
) -> dict[str, Any]:
    """The plan of a batch before it runs (a dry run, ``vcache plan --batch-file``): its
    measures (with the predicted cost), the send order (each item by its ``custom_id``,
    the item it waits for, the tokens it reads from it), the most valuable anchors and,
    per hosted target in ``options``, the provider plan (online in DAG order against the
    provider's batch API, :func:`gateway.batches.provider_plan.compare`)."""
    us = units(endpoint, bodies)
    dag = PrefixDag(us)
    steps = dag.order()
    name = {str(i): cid for i, cid in enumerate(custom_ids)}
    return {
        "object": "batch.plan",
        "endpoint": endpoint,
        "plan": measures(dag, us),
        "order": [
            {
                "custom_id": name[st.unit],
                "after": name[st.after] if st.after is not None else None,
                "shared_tokens": st.shared_tokens,
            }
            for st in steps
        ],
        "anchors": [
            {"tokens": a.tokens, "own_tokens": a.own_tokens, "items": a.units}
            for a in dag.anchors(ANCHORS_SHOWN)
        ],
        "providers": [compare(o, us, steps) for o in options],
    }
