"""The local account: credited as vLLM reported, never as the gateway predicted."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from manifest.ledger import LocalCredit, SavingsLedger


def test_an_approximate_prediction_is_never_credited_beyond_the_report() -> None:
    ledger = SavingsLedger()
    # approximate: 1536 predicted (a hold refused), vLLM served 768 (evicted meanwhile)
    c = ledger.credit_local("replica-0", 768, predicted_tokens=1536, exact=False)
    assert c == LocalCredit("replica-0", 768, 768, 768)
    # approximate and short (a sibling stored more): the report is credited, nothing over
    assert ledger.credit_local("replica-0", 512, 256, exact=False).credited_tokens == 512
    # exact and right; exact and wrong (a miss, counted)
    ledger.credit_local("replica-0", 256, 256)
    ledger.credit_local("replica-0", 0, 256)
    acc = ledger.local["replica-0"]
    assert (acc.reported, acc.credited, acc.unconfirmed, acc.exact_missed) == (1536, 1536, 768, 1)
    assert ledger.local_reused == {"replica-0": 1536}
    ledger.check_integrity()
    acc.credited += 1
    with pytest.raises(AssertionError, match="credited"):
        ledger.check_integrity()
    with pytest.raises(ValueError):
        ledger.credit_local("replica-0", 10, -1)


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["replica-0", "replica-1"]),
            st.integers(0, 4096),
            st.one_of(st.none(), st.integers(0, 4096)),
            st.booleans(),
        ),
        max_size=40,
    )
)
def test_credited_never_exceeds_reported(ops: list[tuple[str, int, int | None, bool]]) -> None:
    ledger = SavingsLedger()
    for replica, cached, predicted, exact in ops:
        c = ledger.credit_local(replica, cached, predicted, exact)
        assert c.credited_tokens <= c.reported_tokens == cached
    ledger.check_integrity()
    for replica, acc in ledger.local.items():
        reported = sum(c for r, c, _, _ in ops if r == replica)
        assert acc.credited == reported
