"""The control loop over hosted-provider anchors: govern, schedule, warm (M3, M5).

An *anchor* is the stable head of a prompt (tools and system prompt) on one
target for one tenant: the unit the provider caches and siblings share.
Every real request records an arrival on its anchor (:meth:`Control.observe`);
every ``tick_s`` the loop asks ``manifest.governor`` what each anchor should
be (ride, heartbeat, lazy, evict; 5-minute or 1-hour tier) and sends the
heartbeats that are due, inside the provider's rate-limit headroom (read from
its headers), ranked by reuse; with too little headroom it warms fewer
anchors, never past the reserve.  Heartbeats only refresh an anchor that is
still warm: a cold anchor is warmed by its next real request (on implicit
providers that one is free), never by a dedicated call.

Agent sessions (:mod:`gateway.providers.tips`): a turn of a named session
plans its conversation tip for the pause that follows (the long tier, or
heartbeats from this loop until the predicted pause has passed), from the
session's observed gaps.

Send-one-then-fan (:meth:`Control.fan_in`): when siblings of a cold anchor
arrive together, the first goes and the rest wait (at most ``fan_wait_s``)
until its answer begins, by which time the provider has written the anchor.

``heartbeat_all`` is the baseline a load test compares against: every anchor
heartbeated before its TTL, no governor, no budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.core.config import ControlSettings, RetentionSettings
from gateway.core.facts import Publish, no_one
from gateway.core.loops import every
from gateway.core.schemas import ChatCompletionRequest, ChatMessage
from gateway.providers.book import PromptView
from gateway.providers.targets import ProviderTarget
from gateway.providers.tips import SessionTips, Tip
from manifest.governor import ArrivalRate, Decision, Economics, TtlOption, Verdict
from manifest.planner import Regime

log = logging.getLogger(__name__)

WarmFn = Callable[[ChatCompletionRequest, str, str, str], Awaitable[object]]
Claim = Callable[[str, float], Awaitable[bool]]
Key = tuple[str, str, str]  # (target, tenant, anchor digest)


def warm_template(req: ChatCompletionRequest) -> ChatCompletionRequest:
    """What a heartbeat sends: the request's leading system prompts (and its tools) with
    a one-character user turn."""
    lead = []
    for m in req.messages:
        if m.role not in ("system", "developer"):
            break
        lead.append(m)
    return req.model_copy(
        update={
            "messages": [*lead, ChatMessage(role="user", content=".")],
            "stream": False,
            "max_tokens": 1,
            "n": 1,
        }
    )


@dataclass
class Anchor:
    target: str
    tenant: str
    digest: str
    tokens: int
    template: ChatCompletionRequest
    arrivals: ArrivalRate
    touched: float  # the last read of it (a real request or a heartbeat) refreshes the TTL
    verdict: Verdict | None = None
    heartbeats: int = 0
    writer: asyncio.Event | None = None  # send-one-then-fan: set once the first has begun
    writer_since: float = 0.0


@dataclass
class Fan:
    """The first of a cold anchor's siblings: ``release`` when its answer begins (the
    siblings held here go on, and the other gateways are told, once)."""

    event: asyncio.Event = field(default_factory=asyncio.Event)
    written: Callable[[], None] = lambda: None

    def release(self) -> None:
        if not self.event.is_set():
            self.event.set()
            self.written()


async def _alone(name: str, ttl_s: float) -> bool:
    return True  # no other gateway: this one is always first


def economics(t: ProviderTarget, latency_value: float) -> Economics:
    """The governor's view of a target: TTL tiers with their write prices."""
    p = t.profile
    if p.regime is Regime.EXPLICIT and len(p.ttl_options_s) >= 2:
        k = p.write_mult / (2.0 if t.config.cache_ttl_s > 300 else 1.25)  # configured prices
        options = (TtlOption(p.ttl_options_s[0], 1.25 * k), TtlOption(p.ttl_options_s[1], 2.0 * k))
        return Economics(p.read_mult, options, latency_value)
    billed = p.regime is Regime.EXPLICIT
    return Economics(p.read_mult, (TtlOption(t.ttl_s, p.write_mult),), latency_value, billed)


def anchor_body(a: Anchor) -> dict[str, Any]:
    """An ``anchor`` fact: what another gateway needs to heartbeat it."""
    return {
        "target": a.target,
        "tenant": a.tenant,
        "digest": a.digest,
        "tokens": a.tokens,
        "template": a.template.model_dump(mode="json", exclude_none=True),
    }


def shadow_price(share_left: float) -> float:
    """μ: nothing while half the headroom is left, rising to 2 as it runs out."""
    return max(0.0, 0.5 - share_left) * 4.0


def _shadow(t: ProviderTarget) -> float:
    """μ of ``t`` from the headroom its last answer reported (0 before any)."""
    limits = t.client.limits
    return shadow_price(limits.share_left()) if limits is not None else 0.0


class Control:
    """Active-active: every gateway observes its own traffic and publishes it
    (``anchor`` when one is first seen, with its heartbeat template; ``arrival`` per
    request; ``touch`` per heartbeat; ``limits`` when a target's headroom changed), so
    every gateway's anchors count every gateway's arrivals; the heartbeats go out from
    the one that ``leads`` (the bus's ``provider-control`` role), so two gateways
    never warm one anchor twice or spend the headroom twice."""

    def __init__(
        self,
        cfg: ControlSettings,
        clock: Callable[[], float],
        publish: Publish = no_one,
        leads: Callable[[], bool] = lambda: True,
        retention: RetentionSettings | None = None,
        claim: Claim | None = None,
    ) -> None:
        """``publish``: the facts this gateway learns, to the others (the state bus's);
        ``leads``: whether this gateway sends the heartbeats (holds the bus's
        ``provider-control`` role); ``claim``: whether it is the first of the gateways to
        write a cold anchor (the bus's; one gateway alone always is)."""
        self.cfg = cfg
        self.clock = clock
        self.publish = publish
        self.leads = leads
        self.claim: Claim = claim or _alone
        self.fanned: dict[Key, float] = {}  # anchors another gateway wrote, and when
        self.tips = SessionTips(cfg, retention or RetentionSettings(), clock)
        self.anchors: dict[Key, Anchor] = {}
        self.targets: dict[str, ProviderTarget] = {}
        self.counts = {"heartbeats": 0, "held": 0, "deferred": 0, "evicted": 0, "failed": 0}
        self.shared_limits: dict[str, object] = {}  # the limits last published per target

    @property
    def enabled(self) -> bool:
        return self.cfg.mode != "off"

    # ------------------------------------------------------------- request path

    def observe(
        self,
        t: ProviderTarget,
        tenant: str,
        view: PromptView,
        req: ChatCompletionRequest | None,
        arrival: bool = True,
    ) -> Anchor | None:
        """The request's anchor (created on first sight), with one arrival counted."""
        i = view.anchor()
        if not self.enabled or i < 0:
            return None
        key = (t.name, tenant, view.digests[i])
        now = self.clock()
        a = self.anchors.get(key)
        if a is None:
            if req is None or len(self.anchors) >= self.cfg.max_anchors:
                return None
            rate = ArrivalRate.empty(self.cfg.horizon_s)
            a = Anchor(t.name, tenant, key[2], view.tokens[i], warm_template(req), rate, now)
            self.anchors[key] = a
            self.targets[t.name] = t
            self.publish("anchor", anchor_body(a))
        if arrival:
            a.arrivals.add(now)
            a.touched = now
            self.publish("arrival", {"key": list(key)})
        return a

    def _share_limits(self) -> None:
        for name, t in self.targets.items():
            lim = t.client.limits
            if lim is not None and self.shared_limits.get(name) is not lim:
                self.shared_limits[name] = lim
                self.publish("limits", {"target": name, **dataclasses.asdict(lim)})

    def session_turn(
        self,
        t: ProviderTarget,
        tenant: str,
        session: str,
        req: ChatCompletionRequest,
        view: PromptView,
    ) -> Tip | None:
        """A turn of an agent session on ``t``: its tip's plan for the pause after it
        (governed only)."""
        if self.cfg.mode != "govern":
            return None
        self.targets.setdefault(t.name, t)
        econ, mu = economics(t, self.cfg.latency_value), _shadow(t)
        return self.tips.begin(t.name, tenant, session, req, view.total_tokens, econ, mu)

    def long_ttl(self, a: Anchor | None) -> bool:
        """Whether the anchor's breakpoint takes the long tier (the governor chose it)."""
        if a is None or self.cfg.mode != "govern" or a.verdict is None:
            return False
        t = self.targets.get(a.target)
        return (
            t is not None
            and len(t.profile.ttl_options_s) >= 2
            and (a.verdict.ttl_s >= t.profile.ttl_options_s[1])
        )

    async def fan_in(self, a: Anchor | None, warm_through: int | None, index: int) -> Fan | None:
        """Hold a sibling of a cold anchor until the first one's answer begins (bounded);
        the first gets the :class:`Fan` to release.  Across gateways the first is the
        one whose claim on the anchor went through; the others' siblings wait for its
        ``fan`` fact."""
        if (
            a is None
            or self.cfg.fan_wait_s <= 0
            or (warm_through is not None and warm_through >= index)
        ):
            return None
        now = self.clock()
        w = a.writer
        window = self.cfg.fan_wait_s * self.cfg.clock_scale
        if w is not None and not w.is_set() and now - a.writer_since <= window:
            await self._hold(w)
            return None
        key = (a.target, a.tenant, a.digest)
        ev = asyncio.Event()  # this gateway's siblings wait on it from now
        a.writer, a.writer_since = ev, now
        if not await self.claim(":".join(key), self.cfg.fan_wait_s):  # another writes it
            began = self.fanned.get(key)
            if began is None or began < now - window:  # and has not yet begun
                await self._hold(ev)
            ev.set()
            return None
        return Fan(ev, lambda: self.publish("fan", {"key": list(key)}))

    async def _hold(self, writer: asyncio.Event) -> None:
        self.counts["held"] += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(writer.wait(), self.cfg.fan_wait_s)

    def learn_fan(self, key: Key) -> None:
        """Another gateway's first sibling of a cold anchor has begun its answer."""
        self.fanned[key] = self.clock()
        a = self.anchors.get(key)
        if a is not None and a.writer is not None:
            a.writer.set()
        if len(self.fanned) > self.cfg.max_anchors:
            oldest = min(self.fanned, key=self.fanned.__getitem__)
            del self.fanned[oldest]

    # ------------------------------------------------------------------- loop

    def verdict(self, a: Anchor, now: float) -> Verdict:
        t = self.targets[a.target]
        return a.arrivals.verdict(economics(t, self.cfg.latency_value), _shadow(t), now)

    def _due(self, a: Anchor, now: float) -> bool:
        """A heartbeat is due before the TTL runs out, never after (then it is cold)."""
        if a.verdict is None:
            return False
        age = now - a.touched
        return self.cfg.heartbeat_at * a.verdict.ttl_s <= age < a.verdict.ttl_s

    def _budget(self, t: ProviderTarget, sent: int, tokens: int, cost: int) -> bool:
        """Room for one more warm of ``cost`` tokens after ``sent`` this tick, keeping
        ``reserve`` of the limits for real traffic."""
        if sent >= self.cfg.max_warms_per_tick:
            return False
        lim = t.client.limits
        if lim is None:
            return True
        r = self.cfg.reserve
        short_of_requests = (
            lim.requests_remaining is not None
            and bool(lim.requests_limit)
            and lim.requests_remaining - sent - 1 < r * (lim.requests_limit or 0)
        )
        short_of_tokens = (
            lim.tokens_remaining is not None
            and bool(lim.tokens_limit)
            and lim.tokens_remaining - tokens - cost < r * (lim.tokens_limit or 0)
        )
        return not (short_of_requests or short_of_tokens)

    def decide(self) -> list[Anchor]:
        """Decide every anchor; the heartbeats that are due, by rank, inside each target's
        headroom (those past it are deferred).  Sends nothing."""
        now = self.clock()
        due: list[Anchor] = []
        for key, a in list(self.anchors.items()):
            a.verdict = self.verdict(a, now)
            if self.cfg.mode == "heartbeat_all":
                ttl = self.targets[a.target].ttl_s
                a.verdict = Verdict(Decision.HEARTBEAT, ttl, 0.0, a.verdict.arrivals_per_ttl)
            elif a.verdict.decision is Decision.EVICT:
                del self.anchors[key]
                self.counts["evicted"] += 1
                continue
            if a.verdict.decision is Decision.HEARTBEAT and self._due(a, now):
                due.append(a)
        due.sort(key=lambda a: a.arrivals.rate(now) * a.tokens, reverse=True)
        sent: dict[str, tuple[int, int]] = {}
        out: list[Anchor] = []
        for a in due:
            t = self.targets[a.target]
            n, tokens = sent.get(a.target, (0, 0))
            if self.cfg.mode == "govern" and not self._budget(t, n, tokens, a.tokens):
                self.counts["deferred"] += 1
                continue
            sent[a.target] = (n + 1, tokens + a.tokens)
            out.append(a)
        return out

    async def tick(self, send: WarmFn) -> list[Anchor]:
        """Decide, then hand over: the due heartbeats sent through ``send`` (the service's
        provider warm, journaled like any request); returns the anchors heartbeated.
        A gateway that does not lead decides too (every gateway counts every arrival, so
        they reach the same verdicts: the TTL tier its own requests write at) and shares
        its targets' headroom, but sends no heartbeat."""
        self._share_limits()
        due = self.decide()
        if not self.leads():
            return []
        beaten = [a for a in due if await self._heartbeat(a, send)]
        for tip in self.tips.due():  # paused agent sessions' conversations
            if await self._warm(send, tip.template, tip.tenant, tip.target):
                self.tips.touched(tip)
        return beaten

    async def _warm(
        self, send: WarmFn, req: ChatCompletionRequest, tenant: str, target: str
    ) -> bool:
        """Send one heartbeat (a failed one is a miss later, never an error now)."""
        try:
            await send(req, tenant, target, f"heartbeat-{uuid.uuid4().hex[:16]}")
        except Exception as exc:
            self.counts["failed"] += 1
            log.warning("%s: heartbeat failed (%s)", target, exc)
            return False
        return True

    async def _heartbeat(self, a: Anchor, send: WarmFn) -> bool:
        if not await self._warm(send, a.template, a.tenant, a.target):
            return False
        a.touched = self.clock()
        self.publish("touch", {"key": [a.target, a.tenant, a.digest]})
        a.heartbeats += 1
        self.counts["heartbeats"] += 1
        return True

    async def run(self, send: WarmFn) -> None:
        async def tick() -> None:
            await self.tick(send)

        await every(self.cfg.tick_s, tick, "control tick")
