"""Agent sessions' tips on a provider: the gap counted at each turn, the pause predicted
from the session's gaps (the tenant's before it has any), heartbeats due while paused
and only inside the predicted pause, a new turn replacing the last one's tip."""

from __future__ import annotations

from gateway.core.config import ControlSettings, RetentionSettings
from gateway.core.schemas import ChatCompletionRequest, ChatMessage
from gateway.providers.tips import MAX_SESSIONS, SessionTips
from manifest.governor import Economics, TtlOption
from manifest.session_tips import TipPlan

ECON = Economics(0.1, (TtlOption(300, 1.25), TtlOption(3600, 2.0)), 1.0)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _req() -> ChatCompletionRequest:
    msgs = [ChatMessage(role="user", content="fix the bug")]
    return ChatCompletionRequest(model="m", messages=msgs, stream=True, max_tokens=500)


def _tips() -> tuple[SessionTips, Clock]:
    clock = Clock()
    retention = RetentionSettings(quantile=0.9, margin=1.0, default_gap_s=30)
    return SessionTips(ControlSettings(mode="govern"), retention, clock), clock


def _turn(tips: SessionTips, clock: Clock, then_s: float) -> None:
    """One turn of session s1, then a pause of ``then_s``."""
    tips.end(tips.begin("anthropic/m", "t", "s1", _req(), 5000, ECON, 0.0))
    clock.now += then_s


def test_before_any_gap_the_default_pause_rides() -> None:
    tips, _ = _tips()
    tip = tips.begin("anthropic/m", "t", "s1", _req(), 5000, ECON, 0.0)
    assert tip.gap_s == 30 and tip.plan is TipPlan.RIDE
    # what a heartbeat would send: the turn's own request, whole, one token
    assert tip.template.messages == _req().messages
    assert tip.template.max_tokens == 1 and not tip.template.stream


def test_gaps_of_six_minutes_plan_heartbeats_due_at_the_ttls_heartbeat_point() -> None:
    tips, clock = _tips()
    for _ in range(2):
        _turn(tips, clock, then_s=360)
    tip = tips.begin("anthropic/m", "t", "s1", _req(), 5000, ECON, 0.0)
    assert tip.gap_s == 360 and tip.plan is TipPlan.HEARTBEAT
    assert tips.due() == []  # the turn still runs
    tips.end(tip)
    clock.now += 200
    assert tips.due() == []  # before 0.8 of the TTL
    clock.now += 50
    assert tips.due() == [tip]
    tips.touched(tip)
    assert tips.due() == [] and tip.heartbeats == 1
    clock.now += 250  # 500 s into a 360 s pause: it has passed, the tip goes cold
    assert tips.due() == []


def test_the_next_turn_replaces_the_tip() -> None:
    tips, clock = _tips()
    for _ in range(2):
        _turn(tips, clock, then_s=360)
    old = tips.begin("anthropic/m", "t", "s1", _req(), 5000, ECON, 0.0)
    tips.end(old)
    clock.now += 100
    tips.begin("anthropic/m", "t", "s1", _req(), 6000, ECON, 0.0)
    clock.now += 150  # the old tip's heartbeat point: it is no longer the session's
    assert tips.due() == []  # and the new one's turn still runs


def test_a_new_session_takes_the_tenants_gaps_and_long_pauses_the_hour_tier() -> None:
    tips, clock = _tips()
    for _ in range(2):
        _turn(tips, clock, then_s=50 * 60)
    first = tips.begin("anthropic/m", "t", "s2", _req(), 5000, ECON, 0.0)
    assert first.gap_s == 50 * 60 and first.plan is TipPlan.LONG
    other = tips.begin("anthropic/m", "t2", "s2", _req(), 5000, ECON, 0.0)
    assert other.plan is TipPlan.RIDE  # another tenant: the default
    assert tips.counts == {"ride": 2, "long": 2}


def test_the_predicted_pause_is_bounded_and_old_sessions_are_forgotten() -> None:
    tips, clock = _tips()
    for _ in range(2):
        _turn(tips, clock, then_s=10 * 3600)
    assert tips.predicted_gap("t", "s1") == ControlSettings().session_max_gap_s
    for i in range(MAX_SESSIONS + 1):
        tips.begin("anthropic/m", "t", f"x{i}", _req(), 10, ECON, 0.0)
    assert len(tips.sessions) == MAX_SESSIONS and ("t", "s1") not in tips.sessions
