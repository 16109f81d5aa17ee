"""The attachments store tests of the hermetic tier, run again where the session log is
PostgreSQL: the objects are rows of its ``attachments`` table, shared by every gateway
over the log (this tier's ``make_store``: a database of the test's own)."""

from __future__ import annotations

import pytest

from tests.unit.sessions.test_attachments import (
    test_a_flipped_byte_is_refused_and_a_put_repairs_it,
    test_a_missing_object_names_its_digest,
    test_a_reference_with_other_metadata_is_refused,
    test_an_image_request_rebuilds_byte_for_byte_and_a_flipped_object_fails,
    test_objects_are_shared_by_two_stores_and_follow_retention,
    test_put_is_idempotent_and_get_verifies,
    test_the_next_turn_through_another_gateway_rebuilds_from_the_shared_store,
    test_turn_parts_carry_the_verified_bytes_in_order,
)

pytestmark = pytest.mark.stores

__all__ = [
    "test_a_flipped_byte_is_refused_and_a_put_repairs_it",
    "test_a_missing_object_names_its_digest",
    "test_a_reference_with_other_metadata_is_refused",
    "test_an_image_request_rebuilds_byte_for_byte_and_a_flipped_object_fails",
    "test_objects_are_shared_by_two_stores_and_follow_retention",
    "test_put_is_idempotent_and_get_verifies",
    "test_the_next_turn_through_another_gateway_rebuilds_from_the_shared_store",
    "test_turn_parts_carry_the_verified_bytes_in_order",
]
