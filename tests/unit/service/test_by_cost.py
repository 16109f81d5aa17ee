"""An alias's targets ordered by what the prompt is expected to cost on each."""

from __future__ import annotations

import pytest

from gateway.core.target import Quote
from gateway.service.targets import by_cost


def _q(name: str, cached: float, price: float = 1.0, read: float = 0.1) -> Quote[None]:
    return Quote(name, 10_000, cached, price, read)


def test_cost_reads_the_cached_tokens_and_prices_the_rest_uncached() -> None:
    q: Quote[None] = Quote("anthropic/m", 10_000, 8_000, 3.0, 0.1)
    # 8,000 read at 0.1 and 2,000 uncached, at 3 per million
    assert q.cost == pytest.approx(3.0 * (800 + 2_000) / 1e6)
    assert Quote("local", 10_000, 8_000, 0.0).cost == 0.0
    # a belief never counts more cached tokens than the prompt has
    assert Quote("p", 100, 500.0, 1.0, 0.5).cost == pytest.approx(100 * 0.5 / 1e6)


def test_targets_are_compared_per_prompt_token_not_by_their_estimates() -> None:
    """One prompt estimated at 120 tokens in one provider's format and 80 in another's,
    both cold at one price: the same rate, so the alias order stands."""
    a: Quote[None] = Quote("a", 120, 0, 1.0, 0.1)
    b: Quote[None] = Quote("b", 80, 0, 1.0, 0.1)
    assert a.rate == b.rate and a.cost > b.cost
    assert by_cost(["a", "b"], [a, b], 0.1) == ["a", "b"]


def test_the_cheapest_goes_first_and_the_rest_follow_by_cost() -> None:
    quotes = [_q("a", 0), _q("b", 9_000), _q("c", 5_000)]
    assert by_cost(["a", "b", "c"], quotes, 0.1) == ["b", "c", "a"]


def test_equal_and_near_costs_keep_the_alias_order() -> None:
    assert by_cost(["a", "b"], [_q("a", 0), _q("b", 0)], 0.1) == ["a", "b"]
    # b 5% cheaper, a 10% margin: a stays first; b 20% cheaper: b goes first
    assert by_cost(["a", "b"], [_q("a", 0), _q("b", 0, price=0.95)], 0.1) == ["a", "b"]
    assert by_cost(["a", "b"], [_q("a", 0), _q("b", 0, price=0.8)], 0.1) == ["b", "a"]


def test_a_free_target_goes_first_and_free_ones_keep_their_order() -> None:
    quotes = [_q("p", 9_000), _q("local", 0, price=0.0), _q("local2", 0, price=0.0)]
    assert by_cost(["p", "local", "local2"], quotes, 0.1) == ["local", "local2", "p"]
