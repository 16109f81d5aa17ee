"""The in-batch hit share the provider plan assumes: measured from finished provider
batches (each sibling by the share of its cacheable prefix it read), kept in the batch
store, moving the stated prior as a belief; calibrated, the plan takes the batch API
where it is cheaper."""

from __future__ import annotations

import dataclasses

import pytest

from gateway.batches.hit_share import HitShares
from gateway.batches.provider_plan import (
    HIT_SHARE,
    PRIOR_WEIGHT,
    belief,
    compare,
    kind_of,
    measure,
)
from gateway.batches.targets import profile_option
from manifest.prefix_dag import PrefixDag, Unit
from tests.unit.batches.conftest import OpenStore


def star(siblings: int, prefix: int, own: int) -> list[Unit]:
    return [Unit(str(i), ("head", f"q{i}"), (prefix, own)) for i in range(siblings)]


def test_each_sibling_counts_by_the_share_of_its_cacheable_prefix_it_read() -> None:
    o = profile_option("openai/gpt-5")  # min 1024, steps of 128
    samples = [
        (0, 2020, 2048, 0),  # a lead: nothing to read
        (2000, 2020, 2048, 1024),  # 2028 expected → 1920 cacheable: 1024/1920
        (2000, 2020, 2048, 1920),  # all of it
        (500, 2020, 2048, 0),  # below the minimum: cannot read
        (2000, 2020, 0, 0),  # no usage (an error): not counted
    ]
    hits, reads = measure(o, samples)
    assert reads == 2 and hits == pytest.approx(1024 / 1920 + 1.0)


def test_the_prior_counts_as_its_weight_and_measures_move_it() -> None:
    assert belief(0.64, 0, 0) == 0.64
    assert belief(0.64, 90, 100) == pytest.approx((0.64 * PRIOR_WEIGHT + 90) / (PRIOR_WEIGHT + 100))


def test_measures_are_kept_per_target_and_kind(open_store: OpenStore) -> None:
    store = open_store()
    shares = HitShares(store)
    assert shares.of("openai/gpt-5") == HIT_SHARE
    shares.learn("openai/gpt-5", "implicit", 90.0, 100)
    shares.learn("openai/gpt-5", "implicit", 0.0, 0)  # nothing that could read: no change
    again = HitShares(open_store())  # another gateway, or after a restart
    got = again.of("openai/gpt-5")
    assert got["implicit"] == pytest.approx(belief(0.64, 90, 100))
    assert got["1h"] == HIT_SHARE["1h"] and again.of("anthropic/x") == HIT_SHARE


def test_a_measured_hit_share_turns_the_plan_to_the_batch_api(open_store: OpenStore) -> None:
    """Ten items under a 2000-token header on Anthropic: at the prior's 0.64 (1-hour TTL)
    online in DAG order is cheaper (4,500 against 9,156); after a batch that read every
    sibling's anchor the belief is 0.967 and the batch API is (3,560)."""
    units = star(10, 2000, 20)
    steps = PrefixDag(units).order()
    target = "anthropic/claude-sonnet-4-5"
    prior = profile_option(target)
    assert kind_of(prior) == "1h"
    before = compare(prior, units, steps)
    assert before["choice"] == "online"
    assert (before["online"]["cost"], before["batch_api"]["cost"]) == (4500.0, 9156.0)
    shares = HitShares(open_store())
    shares.learn(target, "1h", 200.0, 200)
    calibrated = dataclasses.replace(prior, hit_share=shares.of(target))
    after = compare(calibrated, units, steps)
    assert after["batch_api"]["hit_share"] == pytest.approx((0.64 * 20 + 200) / 220, abs=1e-4)
    assert after["choice"] == "batch_api"
    assert after["batch_api"]["cost"] == pytest.approx(3559.6, abs=0.1)
    assert after["batch_api"]["cost"] < after["online"]["cost"] == 4500.0
