"""The session log's store tests of the hermetic tier, run again on PostgreSQL: the same
test functions, here with this tier's ``make_store`` (a database of the test's own)."""

from __future__ import annotations

import pytest

from tests.unit.sessions.test_log_and_store import (
    test_a_new_session_is_created_by_its_first_append,
    test_find_head_is_the_latest_digest_listed_past_one_query,
    test_store_shares_blobs_and_retention_drops_whole_sessions,
)
from tests.unit.sessions.test_log_memo import (
    test_the_remembered_state_is_the_store_folded_after_every_append,
)
from tests.unit.sessions.test_shared_log import (
    test_a_store_that_fails_is_a_503_and_marks_the_log_failing,
    test_an_answer_folds_after_another_gateways_turn,
    test_concurrent_appends_of_two_gateways_to_one_session_interleave_whole,
    test_each_request_keeps_how_it_found_its_session,
    test_two_gateways_continue_one_conversation,
)
from tests.unit.sessions.test_writer import (
    test_a_failing_job_rolls_back_only_its_own_writes,
    test_a_job_alone_that_fails_leaves_nothing_of_its_writes,
    test_concurrent_appends_share_commits_and_are_on_disk_when_acknowledged,
)

pytestmark = pytest.mark.stores

__all__ = [
    "test_a_failing_job_rolls_back_only_its_own_writes",
    "test_a_job_alone_that_fails_leaves_nothing_of_its_writes",
    "test_a_new_session_is_created_by_its_first_append",
    "test_a_store_that_fails_is_a_503_and_marks_the_log_failing",
    "test_an_answer_folds_after_another_gateways_turn",
    "test_concurrent_appends_of_two_gateways_to_one_session_interleave_whole",
    "test_concurrent_appends_share_commits_and_are_on_disk_when_acknowledged",
    "test_each_request_keeps_how_it_found_its_session",
    "test_find_head_is_the_latest_digest_listed_past_one_query",
    "test_store_shares_blobs_and_retention_drops_whole_sessions",
    "test_the_remembered_state_is_the_store_folded_after_every_append",
    "test_two_gateways_continue_one_conversation",
]
