"""The batch store's tests of the hermetic tier, run again where the session log is
PostgreSQL: the batches, items and files are tables of the log's own database, shared
by every gateway over it (``open_store``: stores over a database of this test's own).
Two gateways claiming at once take each item once; a restarted one resumes a batch."""

from __future__ import annotations

import pytest

from gateway.batches.store import BatchStore
from tests.unit.batches.conftest import OpenStore
from tests.unit.batches.test_store import (
    Clock,
    test_a_dead_owners_item_in_a_cancelled_batch_is_canceled_once_its_lease_runs_out,
    test_a_dead_owners_item_is_taken_again_once_its_lease_runs_out,
    test_a_second_store_over_the_same_database_sees_the_first_ones_state,
    test_an_item_is_claimed_once_and_done_only_by_its_owner,
    test_cancel_stops_pending_items_and_the_batch_ends_once_settled,
    test_items_outliving_the_window_expire,
    test_tenants_and_apis_are_apart_and_pages_go_newest_first,
    test_two_gateways_claiming_at_once_take_each_item_once,
)

pytestmark = pytest.mark.stores

__all__ = [
    "test_a_dead_owners_item_in_a_cancelled_batch_is_canceled_once_its_lease_runs_out",
    "test_a_dead_owners_item_is_taken_again_once_its_lease_runs_out",
    "test_a_second_store_over_the_same_database_sees_the_first_ones_state",
    "test_an_item_is_claimed_once_and_done_only_by_its_owner",
    "test_cancel_stops_pending_items_and_the_batch_ends_once_settled",
    "test_items_outliving_the_window_expire",
    "test_tenants_and_apis_are_apart_and_pages_go_newest_first",
    "test_two_gateways_claiming_at_once_take_each_item_once",
]


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(open_store: OpenStore, clock: Clock) -> BatchStore:
    return open_store(clock)
