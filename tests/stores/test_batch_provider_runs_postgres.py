"""Batches on a provider's batch API over a PostgreSQL store: the provider's batch id and
the items it carries kept before it is polled, so a restart (a new runner over the same
database) resumes that batch and never submits again, and one kept before its create is
found (or made) after a kill; a cancel passed on; a submission that never takes failing
its items by name; the measured in-batch hit shares kept per target and kind.  The
hermetic tests, run again here."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.tokenizer import ChatTokenizer
from gateway.batches.store import BatchStore
from tests.providers.conftest import Emulator, emulator, tokenizer
from tests.providers.test_batches import killed_after_create, restart_resumes
from tests.unit.batches.conftest import OpenStore
from tests.unit.batches.test_hit_share import (
    test_a_measured_hit_share_turns_the_plan_to_the_batch_api,
    test_measures_are_kept_per_target_and_kind,
)
from tests.unit.batches.test_runner import (
    test_a_batch_cancelled_while_its_gateway_was_down_cancels_the_providers_batch,
    test_a_cancel_reaches_the_providers_batch_and_keeps_what_it_finished,
    test_a_create_answered_before_the_gateway_died_is_found_not_made_again,
    test_a_restart_resumes_the_providers_batch_and_never_submits_again,
    test_a_submission_kept_but_never_made_is_made_after_the_restart,
    test_a_submission_that_never_takes_fails_each_item_by_name,
)
from tests.unit.batches.test_store import (
    test_a_provider_run_is_kept_until_every_item_it_carries_has_settled,
    test_a_submission_is_kept_before_its_create_and_named_by_its_id_after,
    test_hit_shares_add_up_per_target_and_kind,
)

pytestmark = pytest.mark.stores

__all__ = [
    "emulator",
    "test_a_batch_cancelled_while_its_gateway_was_down_cancels_the_providers_batch",
    "test_a_cancel_reaches_the_providers_batch_and_keeps_what_it_finished",
    "test_a_create_answered_before_the_gateway_died_is_found_not_made_again",
    "test_a_measured_hit_share_turns_the_plan_to_the_batch_api",
    "test_a_provider_run_is_kept_until_every_item_it_carries_has_settled",
    "test_a_restart_resumes_the_providers_batch_and_never_submits_again",
    "test_a_submission_is_kept_before_its_create_and_named_by_its_id_after",
    "test_a_submission_kept_but_never_made_is_made_after_the_restart",
    "test_a_submission_that_never_takes_fails_each_item_by_name",
    "test_hit_shares_add_up_per_target_and_kind",
    "test_measures_are_kept_per_target_and_kind",
    "tokenizer",
]


@pytest.fixture
def store(open_store: OpenStore) -> BatchStore:
    return open_store()


def test_a_gateway_restart_resumes_the_providers_batch_on_postgresql(
    emulator: Emulator, tokenizer: ChatTokenizer, tmp_path: Path, postgres_url: str
) -> None:
    """The gateways over the emulator and one PostgreSQL session log (its batch tables
    there): the second polls the provider batch the first submitted, never submits again."""
    log = {"url": postgres_url, "verify_reconstruction": True}
    restart_resumes(
        emulator, tokenizer, log, lambda: BatchStore(tmp_path / "unused.db", url=postgres_url)
    )
    assert not (tmp_path / "unused.db").exists()


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_a_gateway_killed_between_the_create_and_the_store_write_on_postgresql(
    emulator: Emulator, tokenizer: ChatTokenizer, tmp_path: Path, postgres_url: str, provider: str
) -> None:
    """Killed after the provider made the batch, before its id was written to PostgreSQL:
    the next gateway finds it; one provider batch, every item answered once."""
    log = {"url": postgres_url, "verify_reconstruction": True}
    killed_after_create(
        emulator,
        tokenizer,
        log,
        lambda: BatchStore(tmp_path / "unused.db", url=postgres_url),
        provider,
    )
