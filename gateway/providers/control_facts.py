"""What the provider control loops of active-active gateways tell each other.

Each gateway's :class:`~gateway.providers.control.Control` publishes its own
observations (``anchor``, ``arrival``, ``touch``, ``limits``); these apply the
other gateways' to it, so every gateway's anchors count every gateway's
arrivals, and the one that heartbeats decides on all the traffic and on the
freshest headroom any gateway saw.
"""

from __future__ import annotations

from typing import Any

from engines.providers.ratelimits import RateLimits
from gateway.core.schemas import ChatCompletionRequest
from gateway.providers.control import Anchor, Control, Key, anchor_body
from gateway.providers.targets import ProviderTarget
from manifest.governor import ArrivalRate

_LIMIT_FIELDS = ("requests_limit", "requests_remaining", "tokens_limit", "tokens_remaining")


def _key(raw: Any) -> Key:
    target, tenant, digest = raw
    return (str(target), str(tenant), str(digest))


def learn_anchor(c: Control, body: dict[str, Any], target: ProviderTarget | None) -> None:
    """An anchor another gateway saw first (``target``: this gateway's of that name)."""
    key = (str(body["target"]), str(body["tenant"]), str(body["digest"]))
    if target is None or key in c.anchors or len(c.anchors) >= c.cfg.max_anchors:
        return
    template = ChatCompletionRequest.model_validate(body["template"])
    rate = ArrivalRate.empty(c.cfg.horizon_s)
    c.anchors[key] = Anchor(*key, int(body["tokens"]), template, rate, c.clock())
    c.targets[target.name] = target


def learn_arrival(c: Control, body: dict[str, Any], elapsed: float, arrival: bool) -> None:
    """A request (or, not ``arrival``, a heartbeat) on an anchor through another
    gateway, ``elapsed`` seconds ago on the loop's clock."""
    a = c.anchors.get(_key(body["key"]))
    if a is None:
        return
    when = c.clock() - elapsed
    if arrival:
        a.arrivals.add(when)
    a.touched = max(a.touched, when)


def learn_fan(c: Control, body: dict[str, Any]) -> None:
    """Another gateway's first sibling of a cold anchor has begun its answer: the
    siblings held here go on (send-one-then-fan across gateways)."""
    c.learn_fan(_key(body["key"]))


def learn_limits(c: Control, body: dict[str, Any], at: float) -> None:
    """A target's headroom as another gateway's latest answer reported it (at wall time
    ``at``): the newer report wins."""
    t = c.targets.get(str(body["target"]))
    if t is None or at <= t.client.limits_at:
        return
    t.client.limits = RateLimits(**{k: body.get(k) for k in _LIMIT_FIELDS})
    t.client.limits_at = at
    c.shared_limits[t.name] = t.client.limits  # not published again by this gateway


def anchor_facts(c: Control) -> list[tuple[str, dict[str, Any]]]:
    """Every anchor, as facts (republished after the shared store came back)."""
    return [("anchor", anchor_body(a)) for a in c.anchors.values()]
