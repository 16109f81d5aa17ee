"""What a batch costs as billed, and what the same items would have cost in arrival order.

Costs are in **input-token equivalents**: an uncached prompt token is 1, a prompt
token read from cache is ``read_mult`` (:data:`READ_MULT`, the design note's r = 0.1,
shared/seeds/001 §5).  Output tokens are the same in either order, so they are not
part of the comparison (they are reported in the usage beside it).

- **as billed**: ``(input - cached) + r * cached``, the item's usage as measured;
- **in arrival order**: the same usage without the cache reads the send order bought.
  An item's *bought* tokens are the prefix it reads from the item it waited for (the
  plan's ``shared_tokens`` of its step), scaled from the plan's estimate (one token
  per four bytes) to the measured prompt: ``min(cached, round(input * shared / size))``
  with ``size`` the plan's estimate of its whole prompt.  In arrival order those
  tokens would have been prefilled: ``billed + bought * (1 - r)``.  Cache reads the
  order did not buy (a prefix already resident) are kept in both.

Predicted (before running, from the plan alone): billed ``size - shared * (1 - r)``,
arrival ``size``, summed over the items, in the plan's estimated tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gateway.batches.store import BatchUsage
from manifest.prefix_dag import Step, Unit

READ_MULT = 0.1


def bought(usage: BatchUsage, shared: int, size: int) -> int:
    """The cached tokens of ``usage`` the send order bought (see the module)."""
    if shared <= 0 or size <= 0:
        return 0
    return min(usage.cached, round(usage.input * min(1.0, shared / size)))


def billed(usage: BatchUsage, read_mult: float = READ_MULT) -> float:
    return (usage.input - usage.cached) + read_mult * usage.cached


def arrival(usage: BatchUsage, read_mult: float = READ_MULT) -> float:
    return billed(usage, read_mult) + usage.bought * (1 - read_mult)


def measured(usage: BatchUsage, read_mult: float = READ_MULT) -> dict[str, Any]:
    """The cost of finished items' ``usage`` (an item's, or a batch's totals)."""
    b, a = billed(usage, read_mult), arrival(usage, read_mult)
    return {
        "billed": round(b, 1),
        "arrival_order": round(a, 1),
        "saved": round(a - b, 1),
        "bought_tokens": usage.bought,
    }


def predicted(
    units: Sequence[Unit], steps: Sequence[Step], read_mult: float = READ_MULT
) -> dict[str, Any]:
    """The plan's predicted cost of the whole batch (see the module)."""
    size = {u.id: u.size for u in units}
    arrival_cost = sum(size.values())
    saved = sum(min(st.shared_tokens, size[st.unit]) * (1 - read_mult) for st in steps)
    return {
        "billed": round(arrival_cost - saved, 1),
        "arrival_order": float(arrival_cost),
        "saved": round(saved, 1),
        "read_mult": read_mult,
    }
