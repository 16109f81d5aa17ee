"""A submission to a provider's batch API kept before a restart that the next gateway
cannot follow (:class:`Unreadable`: whether its create made a batch cannot be told, or
its target's batch API is no longer configured): each item it carries ends with that
error, the vcache batch ends, nothing is submitted again and the submission is marked
ended, not looked for at every pass.  The runner over the fake provider route of
tests/unit/batches/test_runner.py; the same over the gateway and the emulator is in
tests/providers/test_batches.py."""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.batches.provider_api import Ticket
from gateway.batches.provider_client import Unreadable
from gateway.batches.store import BatchStore
from tests.unit.batches.conftest import OpenStore
from tests.unit.batches.test_runner import Route, _create, _died, _restarted


class CannotTell(Route):
    """The provider route of a gateway whose look for a kept submission cannot tell
    whether it was made (the list read to its bound)."""

    async def made(self, target: str, ticket: Ticket, n: int) -> str | None:
        self.lookups.append(ticket.token)
        raise Unreadable(f"could not tell whether submission {ticket.token} made a batch")


class Gone(Route):
    """The provider route of a gateway whose configuration dropped the target's provider."""

    async def made(self, target: str, ticket: Ticket, n: int) -> str | None:
        raise Unreadable(f"{target}'s batch API is not configured here")

    async def reopen(self, target: str, items: Any, who: Any, endpoint: str = "") -> Any:
        raise Unreadable(f"{target}'s batch API is not configured here")


def _unreadable(store: BatchStore, bid: str) -> list[str]:
    """Each item's error code, in order."""
    out = []
    for item in store.items(bid):
        assert item.state == "error", item.state
        assert item.result is not None
        out.append(item.result["error"]["code"])
    return out


def test_a_kept_submission_whose_look_cannot_tell_ends_its_items_by_name(
    open_store: OpenStore,
) -> None:
    store = open_store()
    bid = _create(store)
    first = Route("openai/gpt-5", stall=True)  # killed before the create answered
    _died(store, first, lambda: bool(store.provider_runs(bid)))
    again = CannotTell("openai/gpt-5")
    store = open_store()
    _restarted(store, again, bid)
    assert again.lookups == ["token-0"]  # looked for once, not at every pass
    assert again.runs == [] and again.reopened == []  # nothing submitted again
    assert _unreadable(store, bid) == ["provider_batch_unreadable"] * 5
    row = store.batch(bid)
    assert row is not None and row.status == "completed" and row.counts.error == 5
    assert store.provider_runs(bid) == []


def test_a_running_submission_whose_target_is_gone_ends_its_items_by_name(
    open_store: OpenStore,
) -> None:
    store = open_store()
    bid = _create(store)
    first = Route("openai/gpt-5", hold=asyncio.Event())  # never ends for this gateway
    _died(store, first, lambda: any(not r.submitting for r in store.provider_runs(bid)))
    again = Gone("openai/gpt-5")
    store = open_store()
    _restarted(store, again, bid)
    assert again.runs == []
    assert _unreadable(store, bid) == ["provider_batch_unreadable"] * 5
    row = store.batch(bid)
    assert row is not None and row.status == "completed" and row.counts.error == 5
    assert store.provider_runs(bid) == []
