"""Batch state on the session log's database: items claimed under leases, results
written before an item counts as done, cancel, expiry, a batch ended once, tenants
apart, pages newest first."""

from __future__ import annotations

import sqlite3
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from gateway.batches.store import BatchRow, BatchStore, BatchUsage, ItemRow, NewItem
from tests.unit.batches.conftest import OpenStore


class Clock:
    def __init__(self) -> None:
        self.t = 1_000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(open_store: OpenStore, clock: Clock) -> BatchStore:
    return open_store(clock)


def _batch(store: BatchStore, n: int = 3, tenant: str = "one", window_s: float = 100.0) -> str:
    items = [NewItem(f"c{i}", f'{{"i": {i}}}') for i in range(n)]
    return store.create(
        "openai", tenant, "key", "/v1/chat/completions", "m", items, window_s=window_s
    ).id


def _files(batch: BatchRow, items: list[ItemRow]) -> tuple[bytes | None, bytes | None]:
    return b"".join(i.custom_id.encode() for i in items if i.state == "done"), None


def test_an_item_is_claimed_once_and_done_only_by_its_owner(store: BatchStore) -> None:
    bid = _batch(store)
    assert store.claim(bid, 0, "a", lease_s=10)
    assert not store.claim(bid, 0, "b", lease_s=10)  # a holds it
    assert not store.finish(bid, 0, "b", True, 200, {"body": 1}, BatchUsage(5, 2, 1))
    assert store.finish(bid, 0, "a", True, 200, {"body": 1}, BatchUsage(5, 2, 1))
    assert not store.claim(bid, 0, "b", lease_s=10)  # done: never run again
    row = store.batch(bid)
    assert row is not None
    assert (row.counts.done, row.counts.pending, row.totals) == (1, 2, BatchUsage(5, 2, 1))
    assert store.items(bid)[0].result == {"body": 1}


def test_a_dead_owners_item_is_taken_again_once_its_lease_runs_out(
    store: BatchStore, clock: Clock
) -> None:
    bid = _batch(store)
    assert store.claim(bid, 1, "dead", lease_s=10)
    clock.t += 9
    assert not store.claim(bid, 1, "new", lease_s=10)
    assert store.renew("dead", lease_s=10) == 1  # a live owner renews: its lease moves on
    clock.t += 9
    assert not store.claim(bid, 1, "new", lease_s=10)
    clock.t += 11  # the owner stopped renewing
    assert store.claim(bid, 1, "new", lease_s=10)
    assert not store.finish(bid, 1, "dead", True, 200, {}, BatchUsage())  # too late: dropped
    assert store.finish(bid, 1, "new", True, 200, {"by": "new"}, BatchUsage())
    assert store.items(bid)[1].result == {"by": "new"}


def test_cancel_stops_pending_items_and_the_batch_ends_once_settled(store: BatchStore) -> None:
    bid = _batch(store)
    assert store.claim(bid, 0, "a", lease_s=10)
    row = store.cancel(bid, "one", "openai")
    assert row is not None and row.status == "cancelling"
    assert (row.counts.running, row.counts.canceled) == (1, 2)
    assert not store.claim(bid, 1, "a", lease_s=10)  # nothing new once cancelled
    assert not store.finalize(bid, _files)  # item 0 still runs
    assert store.finish(bid, 0, "a", True, 200, {}, BatchUsage(1, 0, 1))
    assert store.finalize(bid, _files)
    assert not store.finalize(bid, _files)  # ended once
    row = store.batch(bid)
    assert row is not None and row.status == "cancelled" and row.ended
    assert row.output_file_id is not None and row.error_file_id is None
    assert store.file_content("one", row.output_file_id) == b"c0"
    assert store.file_content("two", row.output_file_id) is None


def test_items_outliving_the_window_expire(store: BatchStore, clock: Clock) -> None:
    bid = _batch(store, n=2, window_s=50)
    assert store.claim(bid, 0, "a", lease_s=10)
    assert store.finish(bid, 0, "a", True, 200, {}, BatchUsage())
    clock.t += 51
    assert store.expire() == [bid]
    assert store.finalize(bid, _files)
    row = store.batch(bid)
    assert row is not None and (row.status, row.counts.expired, row.counts.done) == (
        "expired",
        1,
        1,
    )


def test_tenants_and_apis_are_apart_and_pages_go_newest_first(
    store: BatchStore, clock: Clock
) -> None:
    ids = []
    for _ in range(5):
        clock.t += 1
        ids.append(_batch(store, n=1))
    theirs = _batch(store, n=1, tenant="two")
    assert store.batch(theirs, "one") is None and store.batch(theirs, "two") is not None
    assert store.batch(ids[0], "one", "anthropic") is None
    assert store.cancel(theirs, "one", "openai") is None
    assert not store.delete(theirs, "one", "openai")
    page, more = store.page("one", "openai", 2)
    assert [b.id for b in page] == ids[::-1][:2] and more
    page, more = store.page("one", "openai", 2, after=page[-1].id)
    assert [b.id for b in page] == ids[::-1][2:4] and more
    page, more = store.page("one", "openai", 2, after=page[-1].id)
    assert [b.id for b in page] == [ids[0]] and not more
    page, _ = store.page("one", "openai", 2, before=ids[0])
    assert [b.id for b in page] == [ids[2], ids[1]]


def test_a_second_store_over_the_same_database_sees_the_first_ones_state(
    open_store: OpenStore, store: BatchStore
) -> None:
    bid = _batch(store)
    assert store.claim(bid, 0, "a", lease_s=10)
    assert store.finish(bid, 0, "a", True, 200, {"x": 1}, BatchUsage(3, 0, 1))
    again = open_store()
    assert [i.state for i in again.items(bid)] == ["done", "pending", "pending"]
    assert again.active() == [bid]
    f = store.add_file("one", "batch", "f.jsonl", b"x")
    assert again.file("one", f.id) == f and again.file_content("one", f.id) == b"x"


def test_two_gateways_claiming_at_once_take_each_item_once(open_store: OpenStore) -> None:
    first, second = open_store(), open_store()
    bid = _batch(first, n=40)

    def claim_all(store: BatchStore, owner: str) -> list[int]:
        return [i for i in range(40) if store.claim(bid, i, owner, lease_s=60)]

    with ThreadPoolExecutor(2) as pool:
        a, b = pool.map(claim_all, (first, second), ("a", "b"))
    assert sorted(a + b) == list(range(40))  # every item once, by one of the two


def test_beside_puts_the_file_next_to_the_session_log(tmp_path: Path) -> None:
    s = BatchStore.beside(tmp_path / "log" / "sessions.db", "normal", None)
    s.close()
    assert (tmp_path / "log" / "batches.db").exists()
    s = BatchStore.beside(tmp_path / "x.db", "normal", f"sqlite:///{tmp_path}/elsewhere/s.db")
    s.close()
    assert (tmp_path / "elsewhere" / "batches.db").exists()


def test_a_provider_run_is_kept_until_every_item_it_carries_has_settled(
    store: BatchStore,
) -> None:
    """A submission to a provider's batch API, with what the log recorded per item; it
    stays running while one of its items is open (a restart that took over only some of
    them), and ends once all have settled."""
    bid = _batch(store, 3)
    for i in range(3):
        assert store.claim(bid, i, "a", 30)
    kept = {i: {"request_id": f"r{i}", "session_id": f"s{i}"} for i in range(2)}
    store.add_provider_run("prov-1", bid, "openai/gpt-5", kept)
    [run] = store.provider_runs(bid)
    assert (run.id, run.target, run.items) == ("prov-1", "openai/gpt-5", kept)
    store.finish(bid, 0, "a", True, 200, {}, BatchUsage())
    assert not store.end_provider_run("prov-1")  # item 1 is still running
    assert [r.id for r in store.provider_runs(bid)] == ["prov-1"]
    assert store.drop(bid, 1, "a", "expired")
    assert store.end_provider_run("prov-1")  # item 2 is open but not carried by it
    assert store.provider_runs(bid) == []
    assert [i.state for i in store.items(bid)] == ["done", "expired", "running"]


def test_hit_shares_add_up_per_target_and_kind(store: BatchStore) -> None:
    store.add_hit_share("openai/gpt-5", "implicit", 8.5, 10)
    store.add_hit_share("openai/gpt-5", "implicit", 1.0, 2)
    store.add_hit_share("anthropic/claude", "1h", 3.0, 4)
    assert store.hit_shares() == {
        ("openai/gpt-5", "implicit"): (9.5, 12.0),
        ("anthropic/claude", "1h"): (3.0, 4.0),
    }


def test_a_store_made_before_provider_runs_opens_with_their_tables(tmp_path: Path) -> None:
    """The tables are made on open (``CREATE TABLE IF NOT EXISTS``): a store file from
    before them takes a provider run."""

    path = tmp_path / "old.db"
    old = BatchStore(path)
    bid = _batch(old)
    old.close()
    with sqlite3.connect(path) as db:
        db.execute("DROP TABLE batch_provider_runs")
        db.execute("DROP TABLE batch_hit_shares")
    store = BatchStore(path)
    try:
        store.add_provider_run("prov-1", bid, "openai/gpt-5", {0: {"request_id": "r0"}})
        assert [r.id for r in store.provider_runs(bid)] == ["prov-1"]
    finally:
        store.close()


def test_a_submission_is_kept_before_its_create_and_named_by_its_id_after(
    store: BatchStore,
) -> None:
    """Kept as ``submitting`` under its token with its lookup and kind; the provider's
    id written over the token once (then ``running``); only a submission still waiting
    for its id can be forgotten; claimed items given back are pending for anyone (canceled
    once the batch is cancelled); a cancelling batch's item is taken only to resume."""
    bid = _batch(store, 2)
    assert store.claim(bid, 0, "a", 30) and store.claim(bid, 1, "a", 30)
    kept = {i: {"request_id": f"r{i}", "session_id": None} for i in range(2)}
    store.add_provider_run("tok-1", bid, "anthropic/c", kept, "1h", {"before": ["b0"]})
    [run] = store.provider_runs(bid)
    assert (run.id, run.state, run.submitting) == ("tok-1", "submitting", True)
    assert (run.kind, run.lookup, run.items) == ("1h", {"before": ["b0"]}, kept)
    assert store.submitted("tok-1", "msgbatch_1")
    assert not store.submitted("tok-1", "msgbatch_2")  # no longer waiting for its id
    [run] = store.provider_runs(bid)
    assert (run.id, run.state, run.submitting) == ("msgbatch_1", "running", False)
    assert not store.forget_provider_run("msgbatch_1")  # made: never forgotten
    store.add_provider_run("tok-2", bid, "anthropic/c", kept)
    assert store.forget_provider_run("tok-2")
    assert [r.id for r in store.provider_runs(bid)] == ["msgbatch_1"]
    assert store.release(bid, [0, 1], "b") == 0  # not b's
    assert store.release(bid, [0], "a") == 1
    assert [i.state for i in store.items(bid)] == ["pending", "running"]
    assert store.claim(bid, 0, "b", 30)
    store.cancel(bid, "one", "openai")  # cancelling: a provider's batch's items are
    assert store.renew("a", -1) == 1  # taken over (a's lease ran out) only to be resumed
    assert not store.claim(bid, 1, "c", 30)
    assert store.claim(bid, 1, "c", 30, resume=True)
    assert store.release(bid, [0], "b") == 1  # given back: canceled, nothing sends it
    assert [i.state for i in store.items(bid)] == ["canceled", "running"]


def test_a_store_made_before_the_lookup_column_opens_with_it(tmp_path: Path) -> None:
    """A provider-runs table from before ``lookup``: the column added on open."""
    path = tmp_path / "old.db"
    old = BatchStore(path)
    bid = _batch(old)
    old.close()
    with sqlite3.connect(path) as db:
        db.execute("ALTER TABLE batch_provider_runs DROP COLUMN lookup")
    store = BatchStore(path)
    try:
        store.add_provider_run("tok", bid, "openai/gpt-5", {0: {"request_id": "r0"}}, None, {})
        [run] = store.provider_runs(bid)
        assert run.lookup == {} and run.submitting
    finally:
        store.close()


def test_a_dead_owners_item_in_a_cancelled_batch_is_canceled_once_its_lease_runs_out(
    store: BatchStore, clock: Clock
) -> None:
    """No runner takes an item of a batch that is no longer in progress: what a dead
    gateway left running would keep the batch cancelling for ever.  Once its lease has
    run out it is canceled, unless a provider's batch carries it (its results are read
    and the cancel passed on by the runner that resumes that batch)."""
    bid = _batch(store, 4)
    assert store.claim(bid, 0, "dead", lease_s=10)
    assert store.claim(bid, 1, "dead", lease_s=10)
    assert store.claim(bid, 2, "live", lease_s=10)
    store.add_provider_run("prov-1", bid, "openai/gpt-5", {1: {"request_id": "r1"}})
    row = store.cancel(bid, "one", "openai")
    assert row is not None and (row.counts.running, row.counts.canceled) == (3, 1)
    clock.t += 5
    assert store.abandon() == 0  # every lease still runs
    assert store.renew("live", lease_s=10) == 1
    clock.t += 6  # the dead owner's leases have run out, the live one's not
    assert store.abandon() == 1
    assert [i.state for i in store.items(bid)] == ["canceled", "running", "running", "canceled"]
    assert store.finish(bid, 2, "live", True, 200, {}, BatchUsage())  # a live owner finishes
    assert not store.finalize(bid, _files)  # item 1: the provider's batch carries it
    assert store.claim(bid, 1, "resumer", lease_s=10, resume=True)
    assert store.drop(bid, 1, "resumer", "canceled")
    assert store.finalize(bid, _files)
    row = store.batch(bid)
    assert row is not None and row.status == "cancelled"
    assert (row.counts.done, row.counts.canceled) == (1, 3)


TOTALS = (
    "SELECT COALESCE(SUM(input_tokens), 0), COALESCE(SUM(cached_tokens), 0), "
    "COALESCE(SUM(output_tokens), 0), COALESCE(SUM(bought_tokens), 0) "
    "FROM batch_items WHERE batch_id = ?"
)


def test_a_batchs_counts_and_totals_are_read_from_an_index_not_its_items_rows(
    tmp_path: Path,
) -> None:
    """A GET of a batch (polled by the SDKs) counts its items by state and sums their
    tokens: both from a covering index, whatever the bodies weigh; a store made before
    that index (with the older one on (batch_id, state)) gets it on open."""
    path = tmp_path / "old.db"
    old = BatchStore(path)
    bid = _batch(old)
    old.close()
    with sqlite3.connect(path) as db:
        db.execute("DROP INDEX batch_items_totals")
        db.execute("CREATE INDEX batch_items_by_state ON batch_items(batch_id, state)")
    store = BatchStore(path)
    try:
        assert store.claim(bid, 0, "a", 30)
        row = store.batch(bid)
        assert row is not None and (row.counts.total, row.counts.running) == (3, 1)
    finally:
        store.close()
    with sqlite3.connect(path) as db:
        indexes = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='index'")}
        plans = [
            " ".join(str(c) for c in r)
            for q in (
                TOTALS,
                "SELECT state, COUNT(*) FROM batch_items WHERE batch_id = ? GROUP BY state",
            )
            for r in db.execute(f"EXPLAIN QUERY PLAN {q}", (bid,))
        ]
    assert "batch_items_totals" in indexes and "batch_items_by_state" not in indexes
    assert all("COVERING INDEX batch_items_totals" in p for p in plans), plans
