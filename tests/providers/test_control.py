"""The control loop on the emulator: heartbeats, the long tier, the rate-limit budget,
send-one-then-fan and the plan.  Both clocks (the gateway's provider clock and the
emulator's) are moved together; each tick is run by hand."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from engines.tokenizer import ChatTokenizer
from gateway.plan_cli import main as plan_main
from gateway.plan_cli import render
from manifest.governor import Decision
from tests.providers.conftest import KEY, MANUAL, MODELS, Emulator, Gw, controlled

ANTHROPIC = f"anthropic/{MODELS['anthropic']}"
OPENAI = f"openai/{MODELS['openai']}"


@pytest.fixture
def heartbeating(emulator: Emulator, tokenizer: ChatTokenizer) -> Iterator[Gw]:
    yield from controlled(emulator, tokenizer, "heartbeat_all")


def test_heartbeats_keep_an_anchor_warm_across_a_gap_longer_than_its_ttl(
    heartbeating: Gw,
) -> None:
    gw = heartbeating
    assert gw.ask(ANTHROPIC)["prompt_tokens_details"]["cached_tokens"] == 0
    for _ in range(3):  # 3 x 250 s idle: twice the 5-minute TTL
        gw.advance(250)
        assert gw.tick() == 1
    warm = gw.emulator.last_body()
    assert warm["max_tokens"] == 0 and warm["system"][0]["cache_control"]["ttl"] == "5m"
    assert gw.ask(ANTHROPIC)["prompt_tokens_details"]["cached_tokens"] > 1000
    assert gw.control().counts["heartbeats"] == 3


def test_without_heartbeats_the_same_gap_is_a_miss(governed: Gw) -> None:
    gw = governed
    gw.ask(ANTHROPIC)
    gw.advance(750)
    gw.tick()
    assert gw.ask(ANTHROPIC)["prompt_tokens_details"]["cached_tokens"] == 0


def test_the_governor_takes_the_hour_tier_for_traffic_with_gaps_past_five_minutes(
    governed: Gw,
) -> None:
    gw = governed
    for _ in range(3):
        gw.ask(ANTHROPIC)
        gw.advance(400)
    gw.tick()
    a = next(iter(gw.control().anchors.values()))
    assert a.verdict is not None and a.verdict.ttl_s == 3600
    gw.ask(ANTHROPIC)
    assert gw.emulator.last_body()["system"][0]["cache_control"]["ttl"] == "1h"
    gw.advance(1200)  # past 5 minutes, inside the hour: still read
    assert gw.ask(ANTHROPIC)["prompt_tokens_details"]["cached_tokens"] > 1000


def _sparse_openai(gw: Gw) -> None:
    for _ in range(3):  # λT ≈ 0.9 on a 300 s implicit cache: the rule says heartbeat
        gw.ask(OPENAI)
        gw.advance(330)
    gw.ask(OPENAI)
    gw.advance(250)


def test_heartbeats_go_out_inside_the_headroom(governed: Gw) -> None:
    _sparse_openai(governed)
    assert governed.tick() == 1
    a = next(iter(governed.control().anchors.values()))
    assert a.verdict is not None and a.verdict.decision is Decision.HEARTBEAT


def test_without_headroom_the_governor_warms_fewer_never_a_429(
    governed: Gw,
) -> None:
    governed.emulator.admin("limits", provider="openai", rpm=100, tpm=2600)
    _sparse_openai(governed)
    assert governed.tick() == 0
    c = governed.control()
    assert c.counts["deferred"] == 1 and c.counts["heartbeats"] == 0
    assert governed.emulator.admin_get("billing")["openai"]["rejected_429"] == 0


def test_siblings_of_a_cold_anchor_wait_for_the_first_to_write_it(governed: Gw) -> None:
    gw = governed
    gw.emulator.admin("faults", kind="timeout", provider="anthropic", delay_s=1.0)
    usages: dict[str, Any] = {}

    def ask(name: str) -> None:
        usages[name] = gw.ask(ANTHROPIC, question=f"question from {name}")

    first = threading.Thread(target=ask, args=("first",))
    first.start()
    threading.Event().wait(0.3)  # the first is on its way (stalled at the provider)
    ask("second")
    first.join()
    assert usages["first"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert usages["second"]["prompt_tokens_details"]["cached_tokens"] > 1000
    assert gw.control().counts["held"] == 1


def test_the_plan_reports_skew_coverage_and_decisions(governed: Gw) -> None:
    gw = governed
    for i, n in enumerate((8, 3, 1)):
        for _ in range(n):
            gw.ask(ANTHROPIC, system=f"Anchor {i}. " + MANUAL)
            gw.advance(20)
    gw.tick()
    r = gw.http.get("/v1/cache/plan", headers={"authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    plan = r.json()["targets"][ANTHROPIC]
    assert plan["anchors"] == 3 and plan["zipf_s"] > 0.5
    assert plan["coverage_top_n"]["1"] > 0.5
    assert plan["break_even_reuse"] == {"300s": 2, "3600s": 3}
    assert plan["decisions"][0]["decision"] == "ride"
    assert sum(d["heartbeats"] for d in plan["decisions"]) == 0
    text = render(r.json())  # what `vcache plan` prints
    assert ANTHROPIC in text and "zipf exponent s" in text and "break-even reuse" in text
    assert len([line for line in text.splitlines() if " ride " in line or " lazy " in line]) == 3


def test_vcache_plan_says_when_the_gateway_cannot_be_reached() -> None:
    assert plan_main("http://127.0.0.1:9", None) == 2
