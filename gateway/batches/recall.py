"""Recall (M4): rebuild a prefix gone cold by replaying its chain, where it pays.

An item whose prompt extends another item's whole prompt (its *parent*,
:meth:`PrefixDag.parents`) reads the parent's prefill from cache when the parent ran
just before it.  When the parent was answered earlier (a batch resumed after a
restart: its prefill is likely evicted), the runner either **replays** the parent's
chain (its ancestors, then it, in topological order, each a warm: the prompt with one
output token, discarded) so the ``k`` items extending it read it from cache, or lets
them **prefill fresh**.

The gate is the design note's (§11.0, :func:`manifest.economics.recall_pays`):
replaying a prefix of ``P`` tokens, read at ``r``, pays only when the ``k`` siblings
recalled together, of ``u`` new tokens each (their mean beyond the parent), save more
than it costs: ``k·u·(1 - r) > P·r``.  Each decision is counted with its predicted
cost, in input-token equivalents: ``replay_cost`` ``P·r``, ``saving`` ``k·u·(1 - r)``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from gateway.batches.cost import READ_MULT
from manifest.economics import recall_pays
from manifest.prefix_dag import Unit

Gate = Callable[[int, int, int], bool]  # (prefix tokens, unit tokens, siblings) -> replay


def default_gate(read_mult: float = READ_MULT) -> Gate:
    """:func:`recall_pays` at ``read_mult``."""
    return partial(recall_pays, read_mult=read_mult)


@dataclass(frozen=True)
class Decision:
    parent: str  # the unit whose prompt the siblings extend
    chain: tuple[str, ...]  # what a replay sends, in topological order (ends at parent)
    siblings: int
    prefix_tokens: int
    unit_tokens: int
    replay: bool
    replay_cost: float
    saving: float
    children: tuple[str, ...] = ()  # the open units extending the parent

    def as_dict(self) -> dict[str, Any]:
        return {
            "parent": self.parent,
            "children": list(self.children),
            "siblings": self.siblings,
            "prefix_tokens": self.prefix_tokens,
            "unit_tokens": self.unit_tokens,
            "decision": "replay" if self.replay else "fresh",
            "replay_cost": self.replay_cost,
            "saving": self.saving,
        }


def chain(parents: Mapping[str, str], unit: str) -> tuple[str, ...]:
    """``unit``'s ancestors then it, root first."""
    out = [unit]
    while out[-1] in parents:
        out.append(parents[out[-1]])
    return tuple(reversed(out))


def decide(
    units: Collection[Unit],
    parents: Mapping[str, str],
    open_: Collection[str],
    gate: Gate,
    read_mult: float = READ_MULT,
) -> list[Decision]:
    """One decision per settled parent with open units extending it (see the module)."""
    size = {u.id: u.size for u in units}
    children: dict[str, list[str]] = {}
    for child, parent in parents.items():
        if child in open_ and parent not in open_:
            children.setdefault(parent, []).append(child)
    out = []
    for parent, kids in sorted(children.items()):
        p = size[parent]
        u = round(sum(size[k] - p for k in kids) / len(kids))
        k = len(kids)
        out.append(
            Decision(
                parent,
                chain(parents, parent),
                k,
                p,
                u,
                gate(p, u, k),
                round(p * read_mult, 1),
                round(k * u * (1 - read_mult), 1),
                tuple(sorted(kids)),
            )
        )
    return out


def warm_body(endpoint: str, body: Mapping[str, Any]) -> dict[str, Any]:
    """A replay of ``body``'s prompt: one output token (the answer is discarded)."""
    out = {k: v for k, v in body.items() if k not in ("max_completion_tokens", "n", "stream")}
    if endpoint == "/v1/responses":
        out["max_output_tokens"] = 16  # the Responses API's least
    else:
        out["max_tokens"] = 1
    return out
