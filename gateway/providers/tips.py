"""Agent sessions on hosted providers: each session's conversation tip kept warm across
its pauses, or left to go cold, by what the pause is expected to cost
(:mod:`manifest.session_tips`).

When a turn of a named session (``x-vcache-session``, an agent's own session
header, ``previous_response_id``) is planned, the gap since the session's last
turn ended is counted, and the pause that will follow this turn is predicted as
the local replicas' retention predicts it: a high quantile of the session's
gaps (the tenant's before it has any; ``cache.retention.default_gap_s`` before
either) times the margin, at most ``control.session_max_gap_s``.  That picks
the turn's :class:`~manifest.session_tips.TipPlan`:

- ``long``: the turn's breakpoints take the long TTL tier (Anthropic's 1 hour);
- ``heartbeat``: once the turn has ended, the control loop reads the tip (the
  turn's own request, prefill only where the provider can) before its TTL runs
  out, until the predicted pause has passed or the next turn begins;
- ``ride`` / ``lazy``: nothing (back within the TTL, or cheaper to write again).

Each gateway keeps its own sessions' tips (a session that moves to another
gateway is heartbeated by the first until its predicted pause has passed).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.core.config import ControlSettings, RetentionSettings
from gateway.core.schemas import ChatCompletionRequest
from manifest.governor import Economics
from manifest.session_tips import Gaps, TipPlan, expected_gap, tip_plan

MAX_SESSIONS = 4096  # sessions remembered (the least recent forgotten)


@dataclass
class Tip:
    """One turn's conversation prefix at a provider, and how it is kept."""

    target: str
    tenant: str
    session: str
    template: ChatCompletionRequest  # what a heartbeat sends: the turn's own request
    tokens: int
    plan: TipPlan
    gap_s: float  # the pause predicted to follow the turn
    ttl_s: float  # the short tier's TTL (a heartbeat goes before it runs out)
    ended_at: float | None = None  # None while the turn runs
    touched: float = 0.0
    heartbeats: int = 0


@dataclass
class _Session:
    gaps: Gaps = field(default_factory=Gaps)
    ended_at: float | None = None
    tip: Tip | None = None


class SessionTips:
    def __init__(
        self,
        cfg: ControlSettings,
        retention: RetentionSettings,
        clock: Callable[[], float],
    ) -> None:
        self.cfg = cfg
        self.retention = retention
        self.clock = clock
        self.sessions: OrderedDict[tuple[str, str], _Session] = OrderedDict()
        self.tenants: dict[str, Gaps] = {}
        self.counts: dict[str, int] = {}

    def predicted_gap(self, tenant: str, session: str) -> float:
        """The pause expected after a turn of ``session``: its gaps' quantile (else the
        tenant's, else the default) times the margin, bounded."""
        r, s = self.retention, self.sessions.get((tenant, session))
        own = s.gaps if s is not None else None
        base = expected_gap(own, self.tenants.get(tenant), r.quantile, r.default_gap_s)
        return min(base * r.margin, self.cfg.session_max_gap_s)

    def begin(
        self,
        target: str,
        tenant: str,
        session: str,
        req: ChatCompletionRequest,
        tokens: int,
        econ: Economics,
        shadow: float,
    ) -> Tip:
        """A turn of ``session`` is planned on ``target``: its gap counted, its tip's plan
        decided (the session's earlier tip is no longer heartbeated)."""
        now = self.clock()
        key = (tenant, session)
        s = self.sessions.pop(key, None) or _Session()
        self.sessions[key] = s  # the most recent last
        if s.ended_at is not None:
            gap = max(now - s.ended_at, 0.0)
            s.gaps.add(gap)
            self.tenants.setdefault(tenant, Gaps()).add(gap)
        s.ended_at = None
        gap_s = self.predicted_gap(tenant, session)
        plan = tip_plan(gap_s, econ, self.cfg.heartbeat_at, shadow)
        ttl = min(o.ttl_s for o in econ.options)
        template = req.model_copy(update={"stream": False, "max_tokens": 1, "n": 1})
        s.tip = Tip(target, tenant, session, template, tokens, plan, gap_s, ttl)
        self.counts[plan.value] = self.counts.get(plan.value, 0) + 1
        while len(self.sessions) > MAX_SESSIONS:
            self.sessions.popitem(last=False)
        return s.tip

    def end(self, tip: Tip) -> None:
        """``tip``'s turn has ended (its answer settled): the pause begins."""
        now = self.clock()
        tip.ended_at = tip.touched = now
        s = self.sessions.get((tip.tenant, tip.session))
        if s is not None and s.tip is tip:
            s.ended_at = now

    def due(self) -> list[Tip]:
        """The tips to heartbeat now: paused, inside their predicted pause, past the
        heartbeat point of their TTL and not yet expired (a cold tip is left cold)."""
        now = self.clock()
        out = []
        for s in self.sessions.values():
            tip = s.tip
            if tip is None or tip.plan is not TipPlan.HEARTBEAT or tip.ended_at is None:
                continue
            age = now - tip.touched
            inside = now - tip.ended_at < tip.gap_s
            if inside and self.cfg.heartbeat_at * tip.ttl_s <= age < tip.ttl_s:
                out.append(tip)
        return out

    def touched(self, tip: Tip) -> None:
        tip.touched = self.clock()
        tip.heartbeats += 1
        self.counts["heartbeats"] = self.counts.get("heartbeats", 0) + 1

    def snapshot(self) -> dict[str, object]:
        paused = [s.tip for s in self.sessions.values() if s.tip and s.tip.ended_at]
        return {
            "sessions": len(self.sessions),
            "paused": len(paused),
            "counts": dict(self.counts),
        }
