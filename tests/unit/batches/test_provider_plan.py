"""The provider plan: online in DAG order under the headroom against the provider's batch
API, with exact numbers from the formulas in gateway/batches/provider_plan.py."""

from __future__ import annotations

import pytest

from gateway.batches.provider_plan import (
    HIT_SHARE,
    Headroom,
    ProviderOption,
    batch_api,
    cacheable,
    compare,
    online,
)
from gateway.batches.targets import profile_option
from manifest.prefix_dag import PrefixDag, Unit


def star(siblings: int, prefix: int, own: int) -> list[Unit]:
    """``siblings`` items under one ``prefix``-token header, each ``own`` tokens more."""
    return [Unit(str(i), ("head", f"q{i}"), (prefix, own)) for i in range(siblings)]


def test_profiles_give_the_design_notes_constants() -> None:
    a = profile_option("anthropic/claude-sonnet-4-5")
    assert (a.explicit, a.read_mult, a.write_mult, a.long_write_mult) == (True, 0.1, 1.25, 2.0)
    assert (a.min_prefix, a.step) == (1024, 1)
    o = profile_option("openai/gpt-5")
    assert (o.explicit, o.read_mult, o.min_prefix, o.step) == (False, 0.5, 1024, 128)
    with pytest.raises(ValueError):
        profile_option("nowhere/x")


def test_cacheable_is_cut_at_the_minimum_and_the_step() -> None:
    o = profile_option("openai/gpt-5")
    assert [cacheable(t, o) for t in (1000, 1024, 1300, 2047)] == [0, 1024, 1280, 1920]


def test_anthropic_online_in_dag_order_reads_every_sibling_and_writes_once() -> None:
    units = star(10, 2000, 20)
    steps = PrefixDag(units).order()
    o = profile_option("anthropic/claude-sonnet-4-5", Headroom(rpm=50, tpm=40_000))
    on = online(o, units, steps)
    # 9 siblings read 2000 at 0.1; the lead writes 2000 at 1.25
    assert on["read_tokens"] == 9 * 2000 and on["write_tokens"] == 2000
    assert on["cost"] == pytest.approx(20_200 - 18_000 * 0.9 + 2000 * 0.25)
    # 40k TPM over 2020-token prompts: 19.8 a minute, below 50 RPM: 10 items in 0.5 min
    assert on["minutes"] == 0.5 and on["feasible"]


def test_anthropic_batch_api_picks_the_1h_ttl_and_its_expected_cost() -> None:
    units = star(10, 2000, 20)
    steps = PrefixDag(units).order()
    o = profile_option("anthropic/claude-sonnet-4-5")
    off = batch_api(o, units, steps)
    h = HIT_SHARE["1h"]  # 1h: 0.64*0.1 + 0.36*2.0 = 0.784 < 5m: 0.3*0.1 + 0.7*1.25 = 0.905
    assert off["ttl"] == "1h" and off["hit_share"] == h
    per = h * 0.1 + (1 - h) * 2.0
    expected = 20_200 - 18_000 + 18_000 * per + 2000 * 1.0
    assert off["cost"] == pytest.approx(0.5 * expected, abs=0.1)


def test_a_heavily_shared_anthropic_batch_is_cheaper_online_in_dag_order() -> None:
    """One 30k-token header over 200 short items: reads at 0.1 beat half price on a best
    effort cache."""
    units = star(200, 30_000, 20)
    steps = PrefixDag(units).order()
    c = compare(profile_option("anthropic/claude-sonnet-4-5"), units, steps)
    assert c["online"]["cost"] < c["batch_api"]["cost"] and c["choice"] == "online"


def test_a_flat_batch_is_cheaper_through_the_batch_api() -> None:
    """Nothing shared: online pays full price, the batch API half."""
    units = [Unit(str(i), (f"h{i}",), (1500,)) for i in range(20)]
    steps = PrefixDag(units).order()
    c = compare(profile_option("openai/gpt-5"), units, steps)
    assert c["online"]["cost"] == 30_000 and c["batch_api"]["cost"] == 15_000
    assert c["choice"] == "batch_api"


def test_online_that_does_not_fit_the_window_goes_to_the_batch_api() -> None:
    units = star(200, 30_000, 20)
    steps = PrefixDag(units).order()
    starved = profile_option("anthropic/claude-sonnet-4-5", Headroom(rpm=None, tpm=1000))
    c = compare(starved, units, steps, window_min=60)
    assert c["online"]["minutes"] > 60 and not c["online"]["feasible"]
    assert c["choice"] == "batch_api"


def test_below_the_minimum_nothing_is_cached_either_way() -> None:
    units = star(10, 500, 20)
    steps = PrefixDag(units).order()
    o = ProviderOption("anthropic/x", True, 0.1, 1.25, 2.0, 1024, 1)
    assert online(o, units, steps)["read_tokens"] == 0
    assert batch_api(o, units, steps)["read_tokens"] == 0
