"""The batch runner: a background task that sends batches' items in the prefix DAG's
order through the service path.

Each pass (every ``poll_s``, or at once when woken: a batch created or cancelled)
expires what outlived its window, cancels the items a dead gateway left running in a
cancelled batch once their leases have run out, and takes every batch in progress
(or cancelling) that it is not already running.  For a batch it builds the prefix
DAG of its items (:mod:`gateway.batches.plan`) and walks :meth:`PrefixDag.order`:
depth first, so an anchor's siblings go together, and each item waits until the item
it is ``after`` (the one that computes the deepest prefix it shares) has begun its
answer (its first token: a chat completion's lead is sent through the streaming path
for that) or ended, before it is sent, so its siblings read that prefix from cache
(send-one-then-fan, shared/seeds/001 §8).  At most ``concurrency`` items run at once
over all batches; each goes through the :class:`Sender` (the service path, at the
``batch`` priority); an item refused for load (429, 503: the queue full for batch
requests, an engine still starting) is sent again after its ``Retry-After``
(:func:`retry_delay`), so load never fails an item.

Items are claimed in the store for ``lease_s`` seconds, renewed every third of it
while they run; an item's result is written before it counts as done.  So a restart
(or another gateway, on a shared PostgreSQL store) resumes a batch: done items are
never sent again, and an item whose runner died is taken again once its lease has
run out.  A cancel stops new items (the walk stops at the next item); items already
sent finish and keep their results.  When a batch has settled, the runner ends it
with its output files (:meth:`BatchStore.finalize`, once over every gateway).

With ``pins`` (:mod:`gateway.batches.pins`), the prefix an item's siblings read from
their lead is pinned when they are let go, under a lease of ``lease_s``, and released
once the last of them has ended (in a ``finally``); :attr:`BatchRunner.pins_counted`
counts the pins taken, skipped (nothing to pin) and released.  With ``recall`` (a cost
gate, :mod:`gateway.batches.recall`), a settled item's prompt chain is replayed before
the open items extending it are sent, where the gate passes; each decision is counted.

Every task the runner starts is its own and awaited: :meth:`BatchRunner.run`'s
cancellation cancels the batches' walks and their items (a cancelled item stays
claimed until its lease runs out, and is sent again after the restart).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Literal, Protocol

from gateway.batches.cost import READ_MULT, billed, bought, measured
from gateway.batches.output_files import output_files
from gateway.batches.pins import AnchorPins, Receipt
from gateway.batches.plan import leads_first, units
from gateway.batches.provider_api import Ticket
from gateway.batches.provider_client import BatchAPIError, Unreadable
from gateway.batches.provider_plan import Choice, Sample
from gateway.batches.recall import Gate, decide, warm_body
from gateway.batches.send import CHAT, Outcome, Sender, batch_caller
from gateway.batches.store import BatchRow, BatchStore, ItemRow
from gateway.core.metrics import Metrics
from gateway.core.types import Principal
from manifest.prefix_dag import PrefixDag, Step, Unit

log = logging.getLogger(__name__)


RETRY_CAP_S = 30.0
NEVER, UNREAD = "", "?"  # a kept submission the provider never made; one not looked up


class Submission(Protocol):
    """Items ready for one submission to a provider's batch API, and those refused."""

    @property
    def target(self) -> str: ...

    @property
    def refused(self) -> dict[int, Outcome]: ...

    def journal(self) -> dict[int, dict[str, str | None]]:
        """Per ready item, what the store keeps to journal its answer after a restart."""
        ...


class ProviderRoute(Protocol):
    """A batch sent to its provider's own batch API (:mod:`gateway.batches.provider_api`)."""

    def choose(
        self, endpoint: str, model: str | None, units: Sequence[Unit], steps: Sequence[Step]
    ) -> Choice | None:
        """The hosted target whose batch API the provider plan chooses, with the TTL its
        items take (None: online)."""
        ...

    async def prepare(
        self,
        target: str,
        items: Sequence[tuple[int, dict[str, Any]]],
        who: Principal,
        ttl: str | None = None,
        endpoint: str = CHAT,
    ) -> Submission:
        """The items (requests of ``endpoint``) validated, rendered (their breakpoints at
        ``ttl``) and journaled for one submission."""
        ...

    def learn(self, target: str, kind: str, samples: Iterable[Sample]) -> None:
        """A finished provider batch's measured hit share, to the plan."""
        ...

    async def reopen(
        self,
        target: str,
        items: Sequence[tuple[int, dict[str, Any], dict[str, str | None]]],
        who: Principal,
        endpoint: str = CHAT,
    ) -> Submission:
        """The items of a submission made before a restart, to read their answers."""
        ...

    async def ticket(self, sub: Any) -> Ticket:
        """What names ``sub``'s submission before it is made (BatchAPIError: the provider
        cannot be read)."""
        ...

    async def submit(self, sub: Any, ticket: Ticket) -> str:
        """The provider's id of the batch made of ``sub`` (BatchAPIError: it never took)."""
        ...

    async def made(self, target: str, ticket: Ticket, n: int) -> str | None:
        """The provider's id of the batch of ``n`` items a kept submission made, or None:
        never made (BatchAPIError: the provider cannot be read)."""
        ...

    def failed(self, sub: Any, exc: Any) -> dict[int, Outcome]:
        """Every ready item's error when the submission never took."""
        ...

    def unreadable(
        self,
        target: str,
        run_id: str,
        items: Mapping[int, Mapping[str, str | None]],
        exc: Unreadable,
    ) -> dict[int, Outcome]:
        """Every item's error for a kept submission that cannot be followed here."""
        ...

    async def finish(
        self, sub: Any, run_id: str, cancelled: Callable[[], Awaitable[bool]]
    ) -> dict[int, Outcome | Literal["canceled", "expired"]]:
        """Wait for the provider's batch, then every item's outcome (or never run)."""
        ...

    async def aclose(self) -> None: ...


def retry_delay(retry_after_s: float | None, attempt: int, cap_s: float = RETRY_CAP_S) -> float:
    """How long an item refused for load waits before it is sent again: the refusal's
    ``Retry-After`` when it gave one, else 0.5 s doubling per attempt; at most ``cap_s``."""
    if retry_after_s is not None:
        return min(cap_s, max(0.0, retry_after_s))
    return min(cap_s, 0.5 * 2.0**attempt)


class BatchRunner:
    def __init__(
        self,
        store: BatchStore,
        send: Sender,
        *,
        concurrency: int = 8,
        lease_s: float = 60.0,
        poll_s: float = 1.0,
        owner: str | None = None,
        pins: AnchorPins | None = None,
        recall: Gate | None = None,
        metrics: Metrics | None = None,
        provider: ProviderRoute | None = None,
    ) -> None:
        """``owner``: this runner's name on the items it claims (unique per process by
        default: a restarted gateway does not take over its old claims before their
        leases run out); ``metrics``: where its counts are exported (``/metrics``);
        ``provider``: a batch the provider plan sends to its provider's own batch API."""
        if concurrency < 1 or lease_s <= 0 or poll_s <= 0:
            raise ValueError("concurrency >= 1, lease_s > 0 and poll_s > 0")
        self._store = store
        self._send = send
        self._lease_s = lease_s
        self._poll_s = poll_s
        self.owner = owner or f"runner-{uuid.uuid4().hex[:12]}"
        self._slots = asyncio.Semaphore(concurrency)
        self._wake = asyncio.Event()
        self._walks: dict[str, asyncio.Task[None]] = {}
        self._pins = pins
        self.pins_counted: Counter[str] = Counter()  # taken, skipped, released
        self._recall = recall
        self.recall_counted: Counter[str] = Counter()  # replay, fresh
        # each with its predicted cost, and once its batch's walk ends its measured one
        self.recall_decisions: list[dict[str, Any]] = []
        self._metrics = metrics
        self._provider = provider
        self.provider_batches: list[dict[str, object]] = []  # sent to a provider's batch API

    def _pinned(self, outcome: str) -> None:
        self.pins_counted[outcome] += 1
        if self._metrics is not None:
            self._metrics.batch_pins.labels(outcome).inc()

    def _item_counted(self, endpoint: str, state: str) -> None:
        if self._metrics is not None:
            self._metrics.batch_items.labels(endpoint, state).inc()

    @property
    def store(self) -> BatchStore:
        return self._store

    def wake(self) -> None:
        """Look for work now (a batch was created or cancelled)."""
        self._wake.set()

    async def run(self) -> None:
        """Run batches until cancelled."""
        heartbeat = asyncio.create_task(self._heartbeat(), name="batch-leases")
        try:
            while True:
                try:
                    await self._pass()
                except Exception:  # a store that failed this pass may answer the next
                    log.exception("batch runner pass failed")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self._poll_s)
                self._wake.clear()
        finally:
            tasks = [heartbeat, *self._walks.values()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self._lease_s / 3)
            try:
                await asyncio.to_thread(self._store.renew, self.owner, self._lease_s)
            except Exception:
                log.exception("renewing batch item leases failed")

    async def _pass(self) -> None:
        store = self._store
        active = await asyncio.to_thread(store.active)
        if not active:
            return  # idle: a read, no write transaction
        await asyncio.to_thread(store.expire)
        await asyncio.to_thread(store.abandon)
        for bid in active:
            if bid not in self._walks:
                task = asyncio.create_task(self._walk(bid), name=f"batch-{bid}")
                self._walks[bid] = task
                task.add_done_callback(self._walked)

    def _walked(self, task: asyncio.Task[None]) -> None:
        self._walks.pop(task.get_name().removeprefix("batch-"), None)
        if not task.cancelled() and task.exception() is not None:
            log.error("batch walk %s failed", task.get_name(), exc_info=task.exception())

    async def _walk(self, bid: str) -> None:
        """Send the batch's unsettled items in DAG order, then end it if it settled."""
        store = self._store
        batch = await asyncio.to_thread(store.batch, bid)
        if batch is None:
            return
        items = await asyncio.to_thread(store.items, bid)
        # parsed and planned off the loop: 10,000 items hold it for a quarter of a second
        # and more, and the interactive traffic it serves comes first
        bodies = await asyncio.to_thread(_bodies, items)
        open_ = {i.idx for i in items if i.state in ("pending", "running")}
        who = batch_caller(batch.tenant, batch.key_name)
        ended: dict[int, asyncio.Event] = {}
        sent: list[asyncio.Task[None]] = []
        held: dict[tuple[int, int], Receipt | None] = {}  # (lead, segments) -> its pin
        left: Counter[tuple[int, int]] = Counter()  # siblings of a pinned prefix not ended
        try:
            if open_:
                ordered = [bodies[i.idx] for i in items]
                us, dag, steps, anchor = await asyncio.to_thread(_plan, batch.endpoint, ordered)
                leads = {lead for lead, _ in anchor.values()}
                left.update(anchor[i] for i in open_ if i in anchor)
                model = bodies[items[0].idx].get("model")
                choice = None
                chained = any(b.get("previous_response_id") for b in bodies.values())
                if self._provider is not None and not chained:  # a chain reads the log
                    named = model if isinstance(model, str) else None
                    choice = self._provider.choose(batch.endpoint, named, us, steps)
                if self._provider is not None:  # submissions made before a restart
                    open_ -= await self._provider_resume(
                        bid, batch.endpoint, steps, open_, bodies, us, who
                    )
                if choice is not None:  # the provider plan: its own batch API is cheaper
                    await self._provider_walk(
                        bid, batch.endpoint, choice, steps, open_, bodies, us, who
                    )
                else:
                    if self._recall is not None:
                        await self._recall_chains(us, dag, {str(i) for i in open_}, bodies, batch)
                    for step in steps:
                        idx = int(step.unit)
                        if idx not in open_:
                            continue
                        lead = ended.get(int(step.after)) if step.after is not None else None
                        if lead is not None:
                            await lead.wait()  # send-one-then-fan
                        key = anchor.get(idx)
                        if key is not None and key not in held and self._pins is not None:
                            held[key] = await self._pin(
                                bid, batch.endpoint, bodies[key[0]], key, who
                            )
                        if await asyncio.to_thread(store.status, bid) != "in_progress":
                            break  # cancelled (or ended elsewhere): no new items
                        await self._slots.acquire()
                        claimed = False
                        try:
                            claimed = await asyncio.to_thread(
                                store.claim, bid, idx, self.owner, self._lease_s
                            )
                        finally:
                            if not claimed:
                                self._slots.release()
                        if not claimed:
                            continue  # settled, or another gateway runs it
                        ended[idx] = done = asyncio.Event()
                        plan = (step.shared_tokens, us[idx].size)
                        item = self._item(
                            bid, idx, batch.endpoint, bodies[idx], who, done, leads, plan
                        )
                        sent.append(
                            asyncio.create_task(
                                self._sibling(item, key, held, left), name=f"batch-item-{bid}-{idx}"
                            )
                        )
            await asyncio.gather(*sent)
            if self._recall is not None:
                await self._recall_measured(bid)
        finally:
            for t in sent:
                t.cancel()
            await asyncio.gather(*sent, return_exceptions=True)
            for key in list(held):  # cancelled, or siblings never sent: release what is held
                await self._release(held.pop(key))
        await asyncio.to_thread(store.finalize, bid, output_files)

    async def aclose(self) -> None:
        """Close what the runner's provider route opened (its own HTTP session)."""
        if self._provider is not None:
            await self._provider.aclose()

    async def _provider_resume(
        self,
        bid: str,
        endpoint: str,
        steps: list[Step],
        open_: set[int],
        bodies: dict[int, dict[str, Any]],
        us: list[Unit],
        who: Principal,
    ) -> set[int]:
        """Resume the batch's submissions kept before a restart: their items claimed again
        once their leases ran out, the provider's batch polled, never submitted again.
        One kept before its create whose id was never written is looked for at the
        provider (its token; Anthropic: the new batch of its size) once all its open
        items are claimed, and polled if found; if not, it is forgotten and its items
        released to be sent like any open item (together: one submission again).
        One that cannot be followed here (:class:`Unreadable`: its target's batch API no
        longer configured, or whether it was made cannot be told) ends each item it
        carries with that error, and is marked ended.
        The items the submissions carry (not to be sent any other way)."""
        assert self._provider is not None
        store = self._store
        plan = {int(st.unit): st for st in steps}
        carried: set[int] = set()
        for run in await asyncio.to_thread(store.provider_runs, bid):
            carried |= set(run.items)
            mine = []
            for idx in sorted(run.items):
                if idx in open_ and await asyncio.to_thread(
                    store.claim, bid, idx, self.owner, self._lease_s, True
                ):
                    mine.append(idx)
            if not mine:
                continue  # settled, or another gateway polls it
            run_id = run.id
            try:
                if run.submitting:
                    if set(mine) != set(run.items) & open_:  # the rest not yet free: all at once
                        await asyncio.to_thread(store.release, bid, mine, self.owner)
                        continue
                    found = await self._adopted(
                        bid, run.id, run.target, run.lookup, run.items, mine
                    )
                    if found == NEVER:
                        carried -= set(run.items)  # sent like any open item
                    if found in (NEVER, UNREAD):
                        continue
                    run_id = found
                self.provider_batches.append(
                    {"batch": bid, "target": run.target, "items": len(mine), "resumed": run_id}
                )
                log.info(
                    "batch %s: resuming %s on %s (%d items)", bid, run_id, run.target, len(mine)
                )
                async with self._slots:
                    kept = [(i, bodies[i], run.items[i]) for i in mine]
                    sub = await self._provider.reopen(run.target, kept, who, endpoint)
                    await self._settle_all(bid, endpoint, sub.refused, plan, us)
                    await self._provider_results(
                        bid, endpoint, sub, run_id, plan, us, run.target, run.kind
                    )
            except Unreadable as exc:  # each item its error, the submission ended
                ended = {i: run.items[i] for i in mine}
                outcomes = self._provider.unreadable(run.target, run_id, ended, exc)
                await self._settle_all(bid, endpoint, outcomes, plan, us)
                await asyncio.to_thread(store.end_provider_run, run_id)
        return carried

    async def _adopted(
        self,
        bid: str,
        token: str,
        target: str,
        lookup: Mapping[str, Any],
        items: Mapping[int, object],
        mine: list[int],
    ) -> str:
        """The provider's id of the batch the submission kept as ``token`` made (its id
        now written), or with ``mine`` released: :data:`NEVER` (not made: the submission
        forgotten) or :data:`UNREAD` (the provider could not be read: kept, looked for
        again at the next pass)."""
        assert self._provider is not None
        store = self._store
        try:
            found = await self._provider.made(target, Ticket(token, lookup), len(items))
        except Unreadable:
            raise  # it cannot be told: its items end (the caller)
        except BatchAPIError as exc:
            log.warning("batch %s: looking for submission %s failed: %s", bid, token, exc)
            await asyncio.to_thread(store.release, bid, mine, self.owner)
            return UNREAD
        if found is None:
            log.info("batch %s: submission %s never reached %s", bid, token, target)
            await asyncio.to_thread(store.forget_provider_run, token)
            await asyncio.to_thread(store.release, bid, mine, self.owner)
            return NEVER
        log.info("batch %s: submission %s found on %s as %s", bid, token, target, found)
        await asyncio.to_thread(store.submitted, token, found)
        return found

    async def _provider_walk(
        self,
        bid: str,
        endpoint: str,
        choice: Choice,
        steps: list[Step],
        open_: set[int],
        bodies: dict[int, dict[str, Any]],
        us: list[Unit],
        who: Principal,
    ) -> None:
        """Claim the open items and send them, leads first (:func:`leads_first`), as one
        batch to the chosen target's own batch API (breakpoints at the plan's TTL), its
        id kept in the store before it is polled; write each result as it came back."""
        assert self._provider is not None
        store = self._store
        target = choice.target
        plan = {int(st.unit): st for st in steps}
        claimed: list[Step] = []
        for st in leads_first(steps):
            idx = int(st.unit)
            if idx in open_ and await asyncio.to_thread(
                store.claim, bid, idx, self.owner, self._lease_s
            ):
                claimed.append(st)
        if not claimed:
            return
        self.provider_batches.append(
            {"batch": bid, "target": target, "items": len(claimed), "ttl": choice.ttl}
        )
        log.info("batch %s: %d items to %s's batch API", bid, len(claimed), target)
        async with self._slots:
            batch = [(int(st.unit), bodies[int(st.unit)]) for st in claimed]
            sub = await self._provider.prepare(target, batch, who, choice.ttl, endpoint)
            await self._settle_all(bid, endpoint, sub.refused, plan, us)
            if not sub.journal():
                return
            try:
                ticket = await self._provider.ticket(sub)
            except BatchAPIError as exc:  # the provider cannot be read: nothing sent
                await self._settle_all(bid, endpoint, self._provider.failed(sub, exc), plan, us)
                return
            # kept before the create: a gateway stopped before its answer is written
            # finds the batch by the ticket after the restart, never makes a second
            await asyncio.to_thread(
                store.add_provider_run,
                ticket.token,
                bid,
                target,
                sub.journal(),
                choice.kind,
                ticket.lookup,
            )
            try:
                run_id = await self._provider.submit(sub, ticket)
            except BatchAPIError as exc:  # never took: every item's named error
                await self._settle_all(bid, endpoint, self._provider.failed(sub, exc), plan, us)
                await asyncio.to_thread(store.end_provider_run, ticket.token)
                return
            await asyncio.to_thread(store.submitted, ticket.token, run_id)
            await self._provider_results(bid, endpoint, sub, run_id, plan, us, target, choice.kind)

    async def _provider_results(
        self,
        bid: str,
        endpoint: str,
        sub: Submission,
        run_id: str,
        plan: dict[int, Step],
        us: list[Unit],
        target: str,
        kind: str | None,
    ) -> None:
        """Wait for the provider's batch ``run_id`` (cancelled there when this batch is),
        write each item's result, give the hit share its answers measured (``kind``) to
        the plan, then mark the submission ended."""
        assert self._provider is not None

        async def cancelled() -> bool:
            return await asyncio.to_thread(self._store.status, bid) != "in_progress"

        outcomes = await self._provider.finish(sub, run_id, cancelled)
        await self._settle_all(bid, endpoint, outcomes, plan, us)
        if kind is not None:
            samples = [
                (plan[i].shared_tokens, us[i].size, out.usage.input, out.usage.cached)
                for i, out in outcomes.items()
                if isinstance(out, Outcome) and out.ok and i in plan
            ]
            try:
                self._provider.learn(target, kind, samples)
            except Exception:  # the plan keeps what it had
                log.exception("batch %s: learning the hit share of %s failed", bid, run_id)
        await asyncio.to_thread(self._store.end_provider_run, run_id)

    async def _settle_all(
        self,
        bid: str,
        endpoint: str,
        outcomes: Mapping[int, Outcome | Literal["canceled", "expired"]],
        plan: dict[int, Step],
        us: list[Unit],
    ) -> None:
        for idx, out in outcomes.items():
            if out == "canceled" or out == "expired":
                if await asyncio.to_thread(self._store.drop, bid, idx, self.owner, out):
                    self._item_counted(endpoint, "dropped")
                continue
            assert isinstance(out, Outcome)
            shared = plan[idx].shared_tokens if idx in plan else 0
            usage = replace(out.usage, bought=bought(out.usage, shared, us[idx].size))
            result = out.result()
            if out.ok:
                result["cost"] = measured(usage)
            kept = await asyncio.to_thread(
                self._store.finish, bid, idx, self.owner, out.ok, out.status_code, result, usage
            )
            if kept:
                self._item_counted(endpoint, "completed" if out.ok else "failed")

    async def _recall_chains(
        self,
        us: list[Unit],
        dag: PrefixDag,
        open_: set[str],
        bodies: dict[int, dict[str, object]],
        batch: BatchRow,
    ) -> None:
        """Recall (M4, :mod:`gateway.batches.recall`): replay the chains that pay, before
        the items extending them are sent; count every decision."""
        assert self._recall is not None
        who = batch_caller(batch.tenant, batch.key_name)
        for d in decide(us, dag.parents(), open_, self._recall):
            decision = "replay" if d.replay else "fresh"
            self.recall_counted[decision] += 1
            entry: dict[str, Any] = {"batch": batch.id, **d.as_dict()}
            self.recall_decisions.append(entry)
            if self._metrics is not None:
                self._metrics.batch_recall.labels(decision).inc()
                tokens = self._metrics.batch_recall_tokens
                tokens.labels(decision, "replay_cost").inc(d.replay_cost)
                tokens.labels(decision, "saving").inc(d.saving)
            spent = 0.0  # the replay as billed
            if d.replay:
                for uid in d.chain:  # topological: each reads the one before from cache
                    async with self._slots:
                        out = await self._send(
                            batch.endpoint, warm_body(batch.endpoint, bodies[int(uid)]), who
                        )
                    spent += billed(out.usage)
                    if not out.ok:  # a replay only helps: the siblings prefill what is missing
                        log.info(
                            "batch %s: replaying item %s failed (%s)", batch.id, uid, out.error
                        )
                        break
            entry["measured"] = {"replay_cost": round(spent, 1)}
            if self._metrics is not None:
                tokens = self._metrics.batch_recall_tokens
                tokens.labels(decision, "replay_cost_measured").inc(spent)

    async def _recall_measured(self, bid: str) -> None:
        """The measured saving of each of the batch's recall decisions, once its items
        have run: what the children of a replay read from cache (their cached tokens at
        ``1 - r``, part of which they may have read without the replay; nothing for a
        decision to prefill fresh), in input-token equivalents like the predicted one.
        The replay's own measured cost is its usage as billed, kept as it is sent."""
        entries = [
            e for e in self.recall_decisions if e["batch"] == bid and "saving" not in e["measured"]
        ]
        if not entries:
            return
        cached = await asyncio.to_thread(self._store.cached_tokens, bid)
        for e in entries:
            replayed = e["decision"] == "replay"
            read = sum(cached.get(int(c), 0) for c in e["children"]) if replayed else 0
            saving = read * (1 - READ_MULT)
            e["measured"]["saving"] = round(saving, 1)
            if self._metrics is not None:
                tokens = self._metrics.batch_recall_tokens
                tokens.labels(e["decision"], "saving_measured").inc(saving)

    async def _pin(
        self, bid: str, endpoint: str, body: dict[str, object], key: tuple[int, int], who: Principal
    ) -> Receipt | None:
        """Pin the prefix the lead ``key[0]`` computed (``key[1]`` segments)."""
        assert self._pins is not None
        owner = Principal(tenant=who.tenant, key_name=f"batch:{bid}:{key[0]}", priority="batch")
        try:
            receipt = await self._pins.pin(endpoint, body, key[1], owner, self._lease_s)
        except Exception:  # pinning only helps: the siblings run without it
            log.exception("batch %s: pinning the anchor of item %d failed", bid, key[0])
            receipt = None
        self._pinned("taken" if receipt is not None else "skipped")
        return receipt

    async def _release(self, receipt: Receipt | None) -> None:
        if receipt is None or self._pins is None:
            return
        try:
            await self._pins.release(receipt)
        except Exception:  # its lease runs out in any case
            log.exception("releasing a batch anchor's pin failed")
        self._pinned("released")

    async def _sibling(
        self,
        item: Awaitable[None],
        key: tuple[int, int] | None,
        held: dict[tuple[int, int], Receipt | None],
        left: Counter[tuple[int, int]],
    ) -> None:
        """Run ``item``; the last sibling of a pinned prefix to end releases its pin."""
        try:
            await item
        finally:
            if key is not None:
                left[key] -= 1
                if left[key] <= 0 and key in held:
                    await self._release(held.pop(key))

    async def _item(
        self,
        bid: str,
        idx: int,
        endpoint: str,
        body: dict[str, object],
        who: Principal,
        done: asyncio.Event,
        leads: set[int],
        plan: tuple[int, int] = (0, 0),
    ) -> None:
        """Send the item (a lead with ``done`` set at its first token, where the sender
        can tell), write its result with its cost (``plan``: the tokens it reads from the
        item it waited for, and its size, as the plan estimates them); ``done`` is set at
        the end in any case."""
        started = done if idx in leads else None
        try:
            attempt = 0
            while (out := await self._send(endpoint, body, who, started)).retryable:
                if await asyncio.to_thread(self._store.status, bid) != "in_progress":
                    await asyncio.to_thread(self._store.drop, bid, idx, self.owner)
                    self._item_counted(endpoint, "dropped")
                    return  # cancelled while it waited to be sent again
                self._item_counted(endpoint, "retried")
                await asyncio.sleep(retry_delay(out.retry_after_s, attempt))
                attempt += 1
            usage = replace(out.usage, bought=bought(out.usage, *plan))
            result = out.result()
            if out.ok:
                result["cost"] = measured(usage)
            kept = await asyncio.to_thread(
                self._store.finish,
                bid,
                idx,
                self.owner,
                out.ok,
                out.status_code,
                result,
                usage,
            )
            if not kept:
                log.warning("batch %s item %d: lease lost, its result dropped", bid, idx)
            else:
                self._item_counted(endpoint, "completed" if out.ok else "failed")
        finally:
            done.set()
            self._slots.release()


def _bodies(items: Sequence[ItemRow]) -> dict[int, dict[str, Any]]:
    """Each item's request body, by its index in the batch."""
    return {i.idx: json.loads(i.body) for i in items}


def _plan(
    endpoint: str, bodies: Sequence[dict[str, Any]]
) -> tuple[list[Unit], PrefixDag, list[Step], dict[int, tuple[int, int]]]:
    """The batch's units, their prefix DAG, its order, and each unit sent after a lead
    with (that lead, how many leading segments they share): pure, run off the loop."""
    us = units(endpoint, bodies)
    dag = PrefixDag(us)
    steps = dag.order()
    anchor = {
        int(st.unit): (int(st.after), _shared(us[int(st.after)], us[int(st.unit)]))
        for st in steps
        if st.after is not None
    }
    return us, dag, steps, anchor


def _shared(a: Unit, b: Unit) -> int:
    """How many leading segments two units share."""
    n = 0
    for x, y in zip(a.blocks, b.blocks, strict=False):
        if x != y:
            break
        n += 1
    return n
