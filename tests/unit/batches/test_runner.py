"""The runner over a real store and a recording sender: items in the prefix DAG's order
(an anchor's siblings together, the lead first and alone until it ends), at the
batch priority, a restart that finishes a half-done batch without sending a done
item again, cancel mid-batch, and an item's error kept as its result."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from gateway.batches.provider_api import Ticket
from gateway.batches.provider_client import BatchAPIError
from gateway.batches.provider_plan import Choice
from gateway.batches.runner import BatchRunner, retry_delay
from gateway.batches.send import Outcome
from gateway.batches.store import BatchStore, BatchUsage, NewItem
from gateway.core.metrics import Metrics
from gateway.core.types import Principal
from tests.unit.batches.conftest import OpenStore
from tests.unit.waits import until

CHAT = "/v1/chat/completions"


def body(system: str, tag: str) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [
            {"role": "system", "content": f"You classify documents. Instruction set {system}."},
            {"role": "user", "content": tag},
        ],
    }


# interleaved as they arrive: two instruction sets
ARRIVAL = [("A", "a1"), ("B", "b1"), ("A", "a2"), ("B", "b2"), ("A", "a3")]


class Sender:
    """Records what is sent and by whom; an item whose tag is gated waits for its gate."""

    def __init__(
        self,
        gated: tuple[str, ...] = (),
        fail: tuple[str, ...] = (),
        busy: dict[str, int] | None = None,
        first_token: bool = False,
    ) -> None:
        self.busy = dict(busy or {})  # tag -> how many times it is refused for load first
        self.first_token = first_token  # set a lead's ``started`` as it is sent
        self.leads: list[bool] = []  # whether each send was a lead's (given ``started``)
        self.sent: list[str] = []
        self.ended: list[str] = []
        self.who: list[Principal] = []
        self.gates = {tag: asyncio.Event() for tag in gated}
        self.fail = fail

    async def __call__(
        self,
        endpoint: str,
        body: dict[str, Any],
        who: Principal,
        started: asyncio.Event | None = None,
    ) -> Outcome:
        tag = body["messages"][-1]["content"]
        self.sent.append(tag)
        self.who.append(who)
        self.leads.append(started is not None)
        if started is not None and self.first_token:
            started.set()  # its answer has begun
        if tag in self.gates:
            await self.gates[tag].wait()
        if self.busy.get(tag, 0) != 0:
            self.busy[tag] -= 1
            err = {"status": 503, "type": "service_unavailable", "message": "queue full"}
            return Outcome(503, f"req-{tag}", error=err, retry_after_s=0.0)
        self.ended.append(tag)
        if tag in self.fail:
            err = {"status": 400, "type": "invalid_request_error", "message": "no", "code": None}
            return Outcome(400, f"req-{tag}", error=err)
        return Outcome(200, f"req-{tag}", body={"tag": tag}, usage=BatchUsage(10, 4, 2))


@pytest.fixture
def store(open_store: OpenStore) -> BatchStore:
    return open_store()


def _create(store: BatchStore, arrival: list[tuple[str, str]] = ARRIVAL) -> str:
    items = [NewItem(tag, json.dumps(body(system, tag))) for system, tag in arrival]
    return store.create("openai", "one", "key", CHAT, "m", items, window_s=3600).id


def _ended(store: BatchStore, bid: str) -> bool:
    row = store.batch(bid)
    return row is not None and row.ended


def test_items_go_in_dag_order_at_the_batch_priority(store: BatchStore) -> None:
    bid = _create(store)
    sender = Sender()

    async def main() -> None:
        runner = BatchRunner(store, sender, concurrency=1, poll_s=0.01)
        task = asyncio.create_task(runner.run())
        await until(lambda: _ended(store, bid), "the batch ended")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    assert sender.sent == ["a1", "a2", "a3", "b1", "b2"]  # depth first, not arrival order
    assert {w.priority for w in sender.who} == {"batch"}
    assert {(w.tenant, w.key_name) for w in sender.who} == {("one", "key")}
    row = store.batch(bid)
    assert row is not None and row.status == "completed"
    # the three siblings (a2, a3, b2) each read their lead's header: 4 cached tokens
    # apiece, all bought by the order (their header is most of their prompt)
    assert (row.counts.done, row.totals) == (5, BatchUsage(50, 20, 10, 12))
    assert row.output_file_id is not None and row.error_file_id is None
    out = store.file_content("one", row.output_file_id)
    assert out is not None
    lines = [json.loads(line) for line in out.decode().splitlines()]
    assert [ln["custom_id"] for ln in lines] == [t for _, t in ARRIVAL]  # input order
    assert all(ln["response"]["body"] == {"tag": ln["custom_id"]} for ln in lines)
    assert all(ln["response"]["status_code"] == 200 and ln["error"] is None for ln in lines)
    costs = {ln["custom_id"]: ln["vcache"]["cost"] for ln in lines}
    # a lead bought nothing: 6 uncached + 0.1 * 4 cached, the same in arrival order
    assert costs["a1"] == {"billed": 6.4, "arrival_order": 6.4, "saved": 0.0, "bought_tokens": 0}
    assert costs["a2"] == {"billed": 6.4, "arrival_order": 10.0, "saved": 3.6, "bought_tokens": 4}


def test_the_lead_goes_alone_then_its_siblings_fan_out(store: BatchStore) -> None:
    bid = _create(store, [("A", "a1"), ("A", "a2"), ("A", "a3"), ("A", "a4")])
    sender = Sender(gated=("a1", "a2", "a3", "a4"))

    async def main() -> None:
        runner = BatchRunner(store, sender, concurrency=8, poll_s=0.01)
        task = asyncio.create_task(runner.run())
        await until(lambda: sender.sent == ["a1"], "the lead sent")
        for _ in range(50):  # the siblings wait while the lead runs
            await asyncio.sleep(0)
        assert sender.sent == ["a1"]
        sender.gates["a1"].set()
        await until(lambda: len(sender.sent) == 4, "the siblings sent together")
        assert sender.ended == ["a1"]  # all three in flight at once
        for tag in ("a2", "a3", "a4"):
            sender.gates[tag].set()
        await until(lambda: _ended(store, bid), "the batch ended")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())


def test_a_restart_finishes_a_half_done_batch_without_sending_done_items(
    store: BatchStore, open_store: OpenStore
) -> None:
    bid = _create(store)
    # the first gateway: a1 answered, a2 under way when it died (its lease never renewed)
    assert store.claim(bid, 0, "first", lease_s=60)
    assert store.finish(bid, 0, "first", True, 200, {"body": {"tag": "a1"}}, BatchUsage(10, 0, 2))
    assert store.claim(bid, 2, "first", lease_s=0.001)
    again = open_store()  # the restarted gateway's store
    sender = Sender()

    async def main() -> None:
        runner = BatchRunner(again, sender, concurrency=2, poll_s=0.01)
        task = asyncio.create_task(runner.run())
        await until(lambda: _ended(again, bid), "the batch ended")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    assert sorted(sender.sent) == ["a2", "a3", "b1", "b2"]  # a1 never again
    items = again.items(bid)
    assert [i.state for i in items] == ["done"] * 5
    assert items[0].result == {"body": {"tag": "a1"}}
    row = again.batch(bid)
    assert row is not None and row.status == "completed" and row.counts.done == 5


def test_cancel_stops_new_items_and_keeps_the_finished(store: BatchStore) -> None:
    bid = _create(store)
    sender = Sender(gated=("a1",))

    async def main() -> None:
        runner = BatchRunner(store, sender, concurrency=4, poll_s=0.01)
        task = asyncio.create_task(runner.run())
        await until(lambda: sender.sent == ["a1"], "the lead sent")
        cancelled = await asyncio.to_thread(store.cancel, bid, "one", "openai")
        assert cancelled is not None and cancelled.status == "cancelling"
        runner.wake()
        sender.gates["a1"].set()
        await until(lambda: _ended(store, bid), "the batch ended")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    assert sender.sent == ["a1"]
    row = store.batch(bid)
    assert row is not None and row.status == "cancelled"
    assert (row.counts.done, row.counts.canceled) == (1, 4)
    assert row.output_file_id is not None and row.error_file_id is not None
    errors = store.file_content("one", row.error_file_id)
    assert errors is not None
    lines = [json.loads(line) for line in errors.decode().splitlines()]
    assert [ln["custom_id"] for ln in lines] == ["b1", "a2", "b2", "a3"]
    assert {ln["error"]["code"] for ln in lines} == {"batch_cancelled"}
    assert all(ln["response"] is None for ln in lines)


def test_an_items_error_is_its_result_and_the_batch_goes_on(store: BatchStore) -> None:
    bid = _create(store)
    sender = Sender(fail=("b1",))

    async def main() -> None:
        runner = BatchRunner(store, sender, concurrency=2, poll_s=0.01)
        task = asyncio.create_task(runner.run())
        await until(lambda: _ended(store, bid), "the batch ended")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    row = store.batch(bid)
    assert row is not None and row.status == "completed"
    assert (row.counts.done, row.counts.error) == (4, 1)
    assert row.error_file_id is not None
    errors = store.file_content("one", row.error_file_id)
    assert errors is not None
    (line,) = [json.loads(x) for x in errors.decode().splitlines()]
    assert line["custom_id"] == "b1"
    assert line["response"]["status_code"] == 400
    assert line["response"]["request_id"] == "req-b1"
    assert line["response"]["body"]["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("retry_after_s", "attempt", "delay"),
    [
        (2.0, 0, 2.0),
        (2.0, 5, 2.0),
        (0.0, 3, 0.0),
        (120.0, 0, 30.0),
        (None, 0, 0.5),
        (None, 3, 4.0),
        (None, 10, 30.0),
    ],
)
def test_retry_delay_follows_retry_after_else_doubles_up_to_the_cap(
    retry_after_s: float | None, attempt: int, delay: float
) -> None:
    assert retry_delay(retry_after_s, attempt) == delay


def test_an_item_refused_for_load_is_sent_again_not_failed(store: BatchStore) -> None:
    bid = _create(store, [("A", "a1"), ("A", "a2")])
    sender = Sender(busy={"a1": 2})

    async def main() -> None:
        runner = BatchRunner(store, sender, concurrency=2, poll_s=0.01)
        task = asyncio.create_task(runner.run())
        await until(lambda: _ended(store, bid), "the batch ended")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    assert sender.sent == ["a1", "a1", "a1", "a2"]  # a2 still waits for its lead's end
    row = store.batch(bid)
    assert row is not None and row.status == "completed" and row.counts.done == 2


def test_an_item_waiting_to_be_sent_again_is_canceled_with_its_batch(store: BatchStore) -> None:
    bid = _create(store, [("A", "a1"), ("A", "a2")])
    sender = Sender(busy={"a1": -1})  # refused for ever

    async def main() -> None:
        runner = BatchRunner(store, sender, concurrency=2, poll_s=0.01)
        task = asyncio.create_task(runner.run())
        await until(lambda: len(sender.sent) >= 3, "a1 refused and sent again")
        await asyncio.to_thread(store.cancel, bid, "one", "openai")
        await until(lambda: _ended(store, bid), "the batch ended")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    assert set(sender.sent) == {"a1"}
    row = store.batch(bid)
    assert row is not None and row.status == "cancelled"
    assert (row.counts.canceled, row.counts.done, row.counts.error) == (2, 0, 0)


class Clock:
    def __init__(self) -> None:
        self.t = 1_000.0

    def __call__(self) -> float:
        return self.t


def test_a_running_items_lease_is_renewed_so_no_other_gateway_takes_it(
    open_store: OpenStore,
) -> None:
    clock = Clock()
    store, other = open_store(clock), open_store(clock)
    bid = _create(store, [("A", "a1")])
    renewals: list[float] = []
    renew = store.renew

    def counted(owner: str, lease_s: float) -> int:
        at = clock.t
        n = renew(owner, lease_s)
        renewals.append(at)  # once committed: the lease runs from ``at``
        return n

    store.renew = counted  # type: ignore[method-assign]
    sender = Sender(gated=("a1",))

    async def main() -> None:
        # a 30 ms lease on the stores' clock, renewed every 10 ms of the loop's
        runner = BatchRunner(store, sender, concurrency=1, lease_s=0.03, poll_s=0.01)
        task = asyncio.create_task(runner.run())
        await until(lambda: sender.sent == ["a1"], "a1 sent and held")
        clock.t += 0.02
        await until(lambda: clock.t in renewals, "a renewal after the clock moved")
        clock.t += 0.02  # past the first lease, inside the renewed one
        assert not await asyncio.to_thread(other.claim, bid, 0, "other", 0.03)
        sender.gates["a1"].set()
        await until(lambda: _ended(store, bid), "the batch ended")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    assert sender.sent == ["a1"]
    row = store.batch(bid)
    assert row is not None and row.counts.done == 1


def test_siblings_fan_out_at_their_leads_first_token(store: BatchStore) -> None:
    bid = _create(store, [("A", "a1"), ("B", "b1"), ("A", "a2"), ("A", "a3")])
    sender = Sender(gated=("a1",), first_token=True)  # a1 begins its answer, then waits

    async def main() -> None:
        runner = BatchRunner(store, sender, concurrency=8, poll_s=0.01)
        task = asyncio.create_task(runner.run())
        await until(lambda: len(sender.sent) == 4, "every item sent")
        assert "a1" not in sender.ended  # its siblings went while it still ran
        sender.gates["a1"].set()
        await until(lambda: _ended(store, bid), "the batch ended")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    assert sender.sent[0] == "a1"
    assert dict(zip(sender.sent, sender.leads, strict=True)) == {
        "a1": True,  # a lead: sent with an event set at its first token
        "a2": False,
        "a3": False,
        "b1": False,  # b1 reads nothing from a1's A branch; nothing waits for it
    }


def test_the_runner_exports_its_items_by_state_as_metrics(store: BatchStore) -> None:
    """/metrics: vcache_batch_items{endpoint, state}: completed, failed, retried."""
    bid = _create(store)
    sender = Sender(fail=("b1",), busy={"a1": 1})
    metrics = Metrics()

    async def main() -> None:
        runner = BatchRunner(store, sender, concurrency=2, poll_s=0.01, metrics=metrics)
        task = asyncio.create_task(runner.run())
        await until(lambda: _ended(store, bid), "the batch ended")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())

    def count(state: str) -> float | None:
        labels = {"endpoint": CHAT, "state": state}
        return metrics.registry.get_sample_value("vcache_batch_items_total", labels)

    assert (count("completed"), count("failed"), count("retried")) == (4.0, 1.0, 1.0)
    assert b"vcache_batch_items_total" in metrics.render()


@dataclass
class Sub:
    target: str
    tags: dict[int, str]
    refused: dict[int, Outcome] = field(default_factory=dict)

    def journal(self) -> dict[int, dict[str, str | None]]:
        return {i: {"request_id": f"req-{t}", "session_id": None} for i, t in self.tags.items()}


class Route:
    """A provider route that takes every batch to ``target``'s batch API: ``submits``
    the submissions made, ``reopened`` those resumed by id; ``hold``: its batches do not
    end until set; ``fail``: every submission fails; ``cancel_keeps``: the tags a
    cancelled provider batch had finished when the cancel reached it; ``made``: the
    provider's batches by the token they were made under (shared by two routes: one
    provider seen by two gateways); ``stall``: a create never answers."""

    def __init__(
        self,
        target: str | None,
        hold: asyncio.Event | None = None,
        fail: bool = False,
        cancel_keeps: tuple[str, ...] | None = None,
        made: dict[str, str] | None = None,
        stall: bool = False,
    ) -> None:
        self.target = target
        self.made_by = made if made is not None else {}
        self.stall = stall
        self.lookups: list[str] = []
        self.runs: list[tuple[str, list[str]]] = []
        self.reopened: list[tuple[str, list[str]]] = []
        self.cancels = 0
        self.learned: list[tuple[str, str, list[Any]]] = []
        self.hold = hold
        self.fail = fail
        self.cancel_keeps = cancel_keeps

    def choose(self, endpoint: str, model: str | None, units: Any, steps: Any) -> Choice | None:
        return None if self.target is None else Choice(self.target, None, "implicit")

    async def prepare(
        self, target: str, items: Any, who: Principal, ttl: Any = None, endpoint: str = CHAT
    ) -> Sub:
        return Sub(target, {idx: str(b["messages"][-1]["content"]) for idx, b in items})

    def learn(self, target: str, kind: str, samples: Any) -> None:
        self.learned.append((target, kind, list(samples)))

    async def reopen(self, target: str, items: Any, who: Principal, endpoint: str = CHAT) -> Sub:
        sub = Sub(target, {idx: str(b["messages"][-1]["content"]) for idx, b, _ in items})
        self.reopened.append((target, list(sub.tags.values())))
        return sub

    async def ticket(self, sub: Sub) -> Ticket:
        return Ticket(f"token-{len(self.made_by) + len(self.runs)}", {"n": len(sub.tags)})

    async def submit(self, sub: Sub, ticket: Ticket) -> str:
        if self.fail:
            raise BatchAPIError("HTTP 503 five times")
        if self.stall:
            await asyncio.Event().wait()  # the gateway dies before the create is sent
        assert ticket.token not in self.made_by
        self.runs.append((sub.target, list(sub.tags.values())))
        self.made_by[ticket.token] = f"run-{len(self.made_by) + 1}"
        return self.made_by[ticket.token]

    async def made(self, target: str, ticket: Ticket, n: int) -> str | None:
        assert ticket.lookup == {"n": n}
        self.lookups.append(ticket.token)
        return self.made_by.get(ticket.token)

    def failed(self, sub: Sub, exc: BatchAPIError) -> dict[int, Outcome]:
        err = {"status": 502, "type": "upstream_error", "code": "provider_batch_submit_failed"}
        return {
            i: Outcome(502, f"req-{t}", error={**err, "message": str(exc)})
            for i, t in sub.tags.items()
        }

    def unreadable(self, target: str, run_id: str, items: Any, exc: Exception) -> dict[int, Any]:
        err = {"status": 502, "type": "upstream_error", "code": "provider_batch_unreadable"}
        return {i: Outcome(502, f"req-{i}", error={**err, "message": str(exc)}) for i in items}

    async def finish(self, sub: Sub, run_id: str, cancelled: Any) -> dict[int, Any]:
        if self.cancel_keeps is not None:
            while not await cancelled():  # noqa: ASYNC110 - the provider polls it so
                await asyncio.sleep(0.01)
            self.cancels += 1
        if self.hold is not None:
            await self.hold.wait()
        usage = BatchUsage(100, 60, 2)
        out: dict[int, Any] = {}
        for idx, tag in sub.tags.items():
            if self.cancel_keeps is not None and tag not in self.cancel_keeps:
                out[idx] = "canceled"
            else:
                out[idx] = Outcome(200, f"req-{tag}", body={"tag": tag}, usage=usage)
        return out

    async def aclose(self) -> None:
        return None


def test_a_batch_the_plan_sends_to_a_providers_batch_api_is_one_submission(
    store: BatchStore,
) -> None:
    """Every open item claimed and sent in one submission, leads first (then the rest in
    DAG order); nothing goes through the online sender; each result written."""
    bid = _create(store)
    sender, route = Sender(), Route("openai/gpt-5")

    async def main() -> None:
        runner = BatchRunner(store, sender, concurrency=2, poll_s=0.01, provider=route)
        task = asyncio.create_task(runner.run())
        await until(lambda: _ended(store, bid), "the batch ended")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert runner.provider_batches == [
            {"batch": bid, "target": "openai/gpt-5", "items": 5, "ttl": None}
        ]

    asyncio.run(main())
    assert sender.sent == []
    assert route.runs == [("openai/gpt-5", ["a1", "b1", "a2", "a3", "b2"])]
    # the answers' usage goes to the plan's hit share: every answered item with its planned
    # shared tokens (the leads a1, b1 none) and size
    [(target, kind, samples)] = route.learned
    assert (target, kind, len(samples)) == ("openai/gpt-5", "implicit", 5)
    assert sorted(sh > 0 for sh, _, _, _ in samples) == [False, False, True, True, True]
    assert all(size > 0 and (prompt, cached) == (100, 60) for _, size, prompt, cached in samples)
    row = store.batch(bid)
    assert row is not None and row.status == "completed" and row.counts.done == 5
    assert row.totals.cached == 5 * 60


def test_a_restart_resumes_the_providers_batch_and_never_submits_again(
    open_store: OpenStore,
) -> None:
    """The provider's batch id is kept before it is polled: a gateway that dies while the
    provider runs the batch leaves it there; the next one (a new runner over the same
    store) claims the items once their leases run out and polls that batch: no second
    submission, every item answered once."""
    store = open_store()
    bid = _create(store)
    first = Route("openai/gpt-5", hold=asyncio.Event())  # never ends for this gateway

    async def before() -> None:
        runner = BatchRunner(store, Sender(), poll_s=0.01, lease_s=0.3, provider=first)
        task = asyncio.create_task(runner.run())
        await until(lambda: _made(store, bid), "the submission was kept with its id")
        task.cancel()  # the gateway dies
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(before())
    assert len(first.runs) == 1
    [run] = store.provider_runs(bid)
    assert (
        run.id == "run-1" and run.target == "openai/gpt-5" and sorted(run.items) == [0, 1, 2, 3, 4]
    )
    assert run.items[0] == {"request_id": "req-a1", "session_id": None}
    again = Route("openai/gpt-5")

    async def after() -> None:
        runner = BatchRunner(open_store(), Sender(), poll_s=0.01, lease_s=0.3, provider=again)
        task = asyncio.create_task(runner.run())
        await until(lambda: _ended(store, bid), "the batch ended")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        # resumed (in parts when the items' leases ran out at different moments)
        resumed = runner.provider_batches
        assert {(r["batch"], r["target"], r["resumed"]) for r in resumed} == {
            (bid, "openai/gpt-5", "run-1")
        }
        assert sum(int(str(r["items"])) for r in resumed) == 5

    asyncio.run(after())
    assert again.runs == []  # nothing submitted again
    tags = sorted(t for target, part in again.reopened for t in part if target == "openai/gpt-5")
    assert tags == ["a1", "a2", "a3", "b1", "b2"]
    row = store.batch(bid)
    assert row is not None and row.status == "completed" and row.counts.done == 5
    assert store.provider_runs(bid) == []


def _made(store: BatchStore, bid: str) -> bool:
    """A submission of the batch is kept with its id at the provider."""
    return any(not r.submitting for r in store.provider_runs(bid))


def _died(store: BatchStore, first: Route, dies: Any) -> None:
    """A gateway (a runner over ``store``) that sends the batch through ``first`` and
    stops once ``dies()`` holds."""

    async def main() -> None:
        runner = BatchRunner(store, Sender(), poll_s=0.01, lease_s=0.3, provider=first)
        task = asyncio.create_task(runner.run())
        await until(dies, "the point the gateway dies at")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())


def _restarted(store: BatchStore, again: Route, bid: str) -> BatchRunner:
    runner = BatchRunner(store, Sender(), poll_s=0.01, lease_s=0.3, provider=again)

    async def main() -> None:
        task = asyncio.create_task(runner.run())
        await until(lambda: _ended(store, bid), "the batch ended")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    return runner


def test_a_create_answered_before_the_gateway_died_is_found_not_made_again(
    open_store: OpenStore,
) -> None:
    """The submission is kept (with its token) before the create: a gateway killed after
    the provider made the batch but before its id was written leaves a submission with
    no id; the next one finds the provider's batch by the token and polls it.  Exactly
    one provider batch, every item answered once."""
    store = open_store()
    bid = _create(store)
    provider: dict[str, str] = {}
    first = Route("openai/gpt-5", made=provider)

    def killed(token: str, run_id: str) -> bool:
        raise RuntimeError("killed between the create and the store write")

    store.submitted = killed  # type: ignore[method-assign]
    _died(store, first, lambda: bool(first.runs))
    [run] = open_store().provider_runs(bid)
    assert run.submitting and run.id == "token-0" and sorted(run.items) == [0, 1, 2, 3, 4]
    again = Route("openai/gpt-5", made=provider)
    store = open_store()
    runner = _restarted(store, again, bid)
    assert again.lookups[:1] == ["token-0"]
    assert len(first.runs) == 1 and again.runs == []  # one provider batch over both
    assert {str(r["resumed"]) for r in runner.provider_batches} == {"run-1"}
    tags = sorted(t for _, part in again.reopened for t in part)
    assert tags == ["a1", "a2", "a3", "b1", "b2"]
    row = store.batch(bid)
    assert row is not None and row.status == "completed" and row.counts.done == 5
    assert [i.state for i in store.items(bid)] == ["done"] * 5
    assert store.provider_runs(bid) == []


def test_a_submission_kept_but_never_made_is_made_after_the_restart(
    open_store: OpenStore,
) -> None:
    """A gateway killed after keeping the submission but before the provider made it:
    the next one looks for it, finds none, and submits the items once."""
    store = open_store()
    bid = _create(store)
    provider: dict[str, str] = {}
    first = Route("openai/gpt-5", made=provider, stall=True)
    _died(store, first, lambda: bool(store.provider_runs(bid)))
    assert first.runs == [] and provider == {}
    again = Route("openai/gpt-5", made=provider)
    runner = _restarted(open_store(), again, bid)
    assert again.lookups[:1] == ["token-0"]
    assert len(again.runs) == 1 and sorted(again.runs[0][1]) == ["a1", "a2", "a3", "b1", "b2"]
    assert again.reopened == []
    assert [r.get("resumed") for r in runner.provider_batches] == [None]
    row = store.batch(bid)
    assert row is not None and row.status == "completed" and row.counts.done == 5
    assert store.provider_runs(bid) == []


def test_a_cancel_reaches_the_providers_batch_and_keeps_what_it_finished(
    store: BatchStore,
) -> None:
    """Cancel of a batch running on a provider's batch API is passed on; the items the
    provider finished before it stopped keep their results, the rest are canceled."""
    bid = _create(store)
    route = Route("openai/gpt-5", cancel_keeps=("a1", "b1"))

    async def main() -> None:
        runner = BatchRunner(store, Sender(), poll_s=0.01, provider=route)
        task = asyncio.create_task(runner.run())
        await until(lambda: _made(store, bid), "the submission was made")
        store.cancel(bid, "one", "openai")
        runner.wake()
        await until(lambda: _ended(store, bid), "the batch ended")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    assert route.cancels == 1
    row = store.batch(bid)
    assert row is not None and row.status == "cancelled"
    assert (row.counts.done, row.counts.canceled) == (2, 3)
    states = {i.custom_id: i.state for i in store.items(bid)}
    assert states == {
        "a1": "done",
        "b1": "done",
        "a2": "canceled",
        "b2": "canceled",
        "a3": "canceled",
    }


def test_a_submission_that_never_takes_fails_each_item_by_name(store: BatchStore) -> None:
    """The provider's batch API failing every try: each item's error names it (none lost,
    nothing sent online instead)."""
    bid = _create(store)
    sender, route = Sender(), Route("openai/gpt-5", fail=True)

    async def main() -> None:
        runner = BatchRunner(store, sender, poll_s=0.01, provider=route)
        task = asyncio.create_task(runner.run())
        await until(lambda: _ended(store, bid), "the batch ended")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    assert sender.sent == []
    row = store.batch(bid)
    assert row is not None and row.status == "completed" and row.counts.error == 5
    codes = {(i.result or {})["error"]["code"] for i in store.items(bid)}
    assert codes == {"provider_batch_submit_failed"}
    assert store.provider_runs(bid) == []


def test_a_batch_cancelled_while_its_gateway_was_down_cancels_the_providers_batch(
    open_store: OpenStore,
) -> None:
    """The gateway dies while the provider runs the batch; the batch is cancelled before
    the next one starts: that one still takes the submission over (its items' leases
    run out), passes the cancel on and keeps what the provider finished."""
    store = open_store()
    bid = _create(store)
    first = Route("openai/gpt-5", hold=asyncio.Event())
    _died(store, first, lambda: _made(store, bid))
    store.cancel(bid, "one", "openai")
    # every lease the dead gateway held has run out (lease_s 0.3), so the next one takes
    # the submission over in one pass: a takeover in parts (leases claimed at different
    # times on a loaded host) would wait on it, and pass the cancel on, once per part
    time.sleep(0.4)
    again = Route("openai/gpt-5", cancel_keeps=("a1",))
    _restarted(open_store(), again, bid)
    assert again.cancels == 1 and again.runs == []
    row = store.batch(bid)
    assert row is not None and row.status == "cancelled"
    assert (row.counts.done, row.counts.canceled) == (1, 4)


def test_the_batch_is_parsed_and_planned_off_the_event_loop(
    store: BatchStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch of 10,000 items holds the loop a quarter of a second and more while its
    bodies are parsed and its DAG built: interactive requests come first, so neither
    runs on the loop's thread."""
    import threading

    import gateway.batches.runner as runner_module

    bid = _create(store)
    threads: dict[str, threading.Thread] = {}
    parse, plan = runner_module._bodies, runner_module._plan

    def parsed(items: Any) -> Any:
        threads["parse"] = threading.current_thread()
        return parse(items)

    def planned(endpoint: str, bodies: Any) -> Any:
        threads["plan"] = threading.current_thread()
        return plan(endpoint, bodies)

    monkeypatch.setattr(runner_module, "_bodies", parsed)
    monkeypatch.setattr(runner_module, "_plan", planned)
    sender = Sender()

    async def main() -> threading.Thread:
        runner = BatchRunner(store, sender, concurrency=1, poll_s=0.01)
        task = asyncio.create_task(runner.run())
        await until(lambda: _ended(store, bid), "the batch ended")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return threading.current_thread()

    loop_thread = asyncio.run(main())
    assert sender.sent == ["a1", "a2", "a3", "b1", "b2"]  # the same DAG order
    assert set(threads) == {"parse", "plan"}
    assert loop_thread not in threads.values()
