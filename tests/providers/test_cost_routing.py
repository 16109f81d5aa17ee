"""An alias's targets ordered by what the prompt costs on each: a target believed warm
goes first, verified by the provider's own usage telemetry; costs alike keep the
alias order; ``routing.by: order`` keeps it always."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from engines.tokenizer import ChatTokenizer
from tests.providers.conftest import MODELS, Emulator, Gw, make_gateway

ANTHROPIC = f"anthropic/{MODELS['anthropic']}"
OPENAI = f"openai/{MODELS['openai']}"


def _routes(gw: Gw) -> dict[str, float]:
    """vcache_alias_routes_total by target and reason."""
    out = {}
    for line in gw.http.get("/metrics").text.splitlines():
        if line.startswith("vcache_alias_routes_total{"):
            labels, value = line.split("} ")
            out[labels.removeprefix("vcache_alias_routes_total{")] = float(value)
    return out


@pytest.fixture
def two(emulator: Emulator, tokenizer: ChatTokenizer) -> Iterator[Gw]:
    emulator.admin("reset")
    yield from make_gateway(emulator, tokenizer, aliases={"two": [ANTHROPIC, OPENAI]})


def test_cold_everywhere_the_alias_order_decides(two: Gw) -> None:
    r = two.chat("two", "what is a block?")
    assert r.headers["x-vcache-target"] == ANTHROPIC
    assert r.headers["x-vcache-routed-by"] == "order"
    assert _routes(two) == {f'by="order",target="{ANTHROPIC}"': 1.0}


def test_the_target_believed_warm_goes_first_and_its_hit_is_verified(two: Gw) -> None:
    # the manual is written at OpenAI (its first answer) and read back (the second)
    for q in ("what is a block?", "what is a span?"):
        two.chat(OPENAI, q)
    assert two.stats()[OPENAI]["cached_tokens"] > 0  # read back: believed warm now
    r = two.chat("two", "what is a lease?")
    assert r.headers["x-vcache-target"] == OPENAI
    assert r.headers["x-vcache-routed-by"] == "cost"
    assert "x-vcache-fallback-from" not in r.headers  # chosen, not fallen back to
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0.8 * r.json()["usage"]["prompt_tokens"]  # the provider's own count
    assert _routes(two) == {f'by="cost",target="{OPENAI}"': 1.0}


def test_routing_by_order_keeps_the_alias_order(
    emulator: Emulator, tokenizer: ChatTokenizer
) -> None:
    emulator.admin("reset")
    aliases = {"two": [ANTHROPIC, OPENAI]}
    for gw in make_gateway(emulator, tokenizer, aliases=aliases, routing={"by": "order"}):
        for q in ("what is a block?", "what is a span?"):
            gw.chat(OPENAI, q)
        r = gw.chat("two", "what is a lease?")
        assert r.headers["x-vcache-target"] == ANTHROPIC
        assert "x-vcache-routed-by" not in r.headers


def test_a_priced_local_model_gives_way_to_a_provider_that_holds_the_prompt(
    emulator: Emulator, tokenizer: ChatTokenizer
) -> None:
    """The local replicas priced at half the provider's (their GPU time is not free
    here): a prompt nobody holds costs less locally and stays there; one the provider
    holds warm costs a tenth there, so the provider serves it."""
    emulator.admin("reset")
    settings: dict[str, Any] = {
        "aliases": {"smart": ["local", ANTHROPIC]},
        "routing": {"local_input_price": 0.5},  # the provider: 1.0 (unset)
    }
    for gw in make_gateway(emulator, tokenizer, max_model_len=8192, **settings):
        cold = gw.chat("smart", "what is a block?")
        assert cold.headers["x-vcache-target"] == "local"
        for q in ("what is a span?", "what is a pin?"):
            gw.chat(ANTHROPIC, q)
        warm = gw.chat("smart", "what is a lease?")
        assert warm.headers["x-vcache-target"] == ANTHROPIC
        assert warm.headers["x-vcache-routed-by"] == "cost"
        assert warm.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_the_local_model_at_its_default_price_stays_first(
    emulator: Emulator, tokenizer: ChatTokenizer
) -> None:
    emulator.admin("reset")
    for gw in make_gateway(emulator, tokenizer, max_model_len=8192):
        for q in ("what is a span?", "what is a pin?"):
            gw.chat(ANTHROPIC, q)
        r = gw.chat("smart", "what is a lease?")  # smart: [local, anthropic]
        assert r.headers["x-vcache-target"] == "local"
        assert r.headers["x-vcache-routed-by"] == "order"
