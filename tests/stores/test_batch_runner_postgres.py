"""The batch runner's tests of the hermetic tier over a PostgreSQL store: the DAG's
order, send-one-then-fan, a restart resuming a half-done batch without re-sending,
cancel, errors and retries, with the state in the session log's PostgreSQL."""

from __future__ import annotations

import pytest

from gateway.batches.store import BatchStore
from tests.unit.batches.conftest import OpenStore
from tests.unit.batches.test_runner import (
    test_a_restart_finishes_a_half_done_batch_without_sending_done_items,
    test_a_running_items_lease_is_renewed_so_no_other_gateway_takes_it,
    test_an_item_refused_for_load_is_sent_again_not_failed,
    test_an_item_waiting_to_be_sent_again_is_canceled_with_its_batch,
    test_an_items_error_is_its_result_and_the_batch_goes_on,
    test_cancel_stops_new_items_and_keeps_the_finished,
    test_items_go_in_dag_order_at_the_batch_priority,
    test_siblings_fan_out_at_their_leads_first_token,
    test_the_lead_goes_alone_then_its_siblings_fan_out,
)

pytestmark = pytest.mark.stores

__all__ = [
    "test_a_restart_finishes_a_half_done_batch_without_sending_done_items",
    "test_a_running_items_lease_is_renewed_so_no_other_gateway_takes_it",
    "test_an_item_refused_for_load_is_sent_again_not_failed",
    "test_an_item_waiting_to_be_sent_again_is_canceled_with_its_batch",
    "test_an_items_error_is_its_result_and_the_batch_goes_on",
    "test_cancel_stops_new_items_and_keeps_the_finished",
    "test_items_go_in_dag_order_at_the_batch_priority",
    "test_siblings_fan_out_at_their_leads_first_token",
    "test_the_lead_goes_alone_then_its_siblings_fan_out",
]


@pytest.fixture
def store(open_store: OpenStore) -> BatchStore:
    return open_store()
