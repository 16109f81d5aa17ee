"""A batch's cost as billed and in arrival order: the cache reads the order bought
(the plan's shared share of the measured prompt, at most what was cached) priced as
prefill in arrival order; predicted from the plan alone."""

from __future__ import annotations

from gateway.batches.cost import arrival, billed, bought, measured, predicted
from gateway.batches.store import BatchUsage
from manifest.prefix_dag import PrefixDag, Unit


def test_bought_is_the_plans_shared_share_of_the_prompt_at_most_the_cached() -> None:
    u = BatchUsage(input=1000, cached=900, output=50)
    assert bought(u, shared=75, size=100) == 750  # 75% of the measured prompt
    assert bought(u, shared=100, size=100) == 900  # never more than was read from cache
    assert bought(u, shared=0, size=100) == 0  # a lead, or an item under no anchor
    assert bought(BatchUsage(1000, 0, 5), shared=75, size=100) == 0  # a cache miss bought none


def test_arrival_order_prefills_what_the_order_bought_and_keeps_other_reads() -> None:
    u = BatchUsage(input=1000, cached=900, output=50, bought=750)
    assert billed(u) == 100 + 0.1 * 900
    # the 150 cached tokens the order did not buy stay reads in arrival order
    assert arrival(u) == 100 + 750 + 0.1 * 150
    assert measured(u) == {
        "billed": 190.0,
        "arrival_order": 865.0,
        "saved": 675.0,
        "bought_tokens": 750,
    }


def test_predicted_cost_from_the_plan() -> None:
    # a 100-token header shared by three units of 110 tokens: two siblings read it
    units = [Unit(str(i), ("h", f"t{i}"), (100, 10)) for i in range(3)]
    steps = PrefixDag(units).order()
    assert [st.shared_tokens for st in steps] == [0, 100, 100]
    assert predicted(units, steps) == {
        "billed": 150.0,  # 330 - 2 * 100 * 0.9
        "arrival_order": 330.0,
        "saved": 180.0,
        "read_mult": 0.1,
    }
