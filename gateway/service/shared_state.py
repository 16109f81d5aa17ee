"""The state active-active gateways share, from the state bus: the hosted-provider
belief and control loop, and the per-key rate-limit windows.

The book's belief and render records, and the control loop's anchors,
arrivals and headroom, go out as facts and come back from the other gateways
(:mod:`gateway.state.bus`).  What goes out leaves through the publisher each
of them is built with (the bus's ``publish``, passed in by ``gateway/app.py``);
what comes back is applied by the handlers registered here.  The control
loop's heartbeats are sent only by the gateway that holds the
``provider-control`` role (:func:`control_leads`), and a cold anchor is written
by the gateway whose claim on it went through (the bus's ``claim``; the others'
siblings wait for its ``fan`` fact).  Facts carry wall-clock ages; a load
test's time-scaled provider clock (``control.clock_scale``) turns them into its
own seconds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from gateway.core.errors import APIError
from gateway.providers.control import Control
from gateway.providers.control_facts import (
    anchor_facts,
    learn_anchor,
    learn_arrival,
    learn_fan,
    learn_limits,
)
from gateway.providers.path import ProviderPath
from gateway.providers.targets import ProviderTarget
from gateway.service.limits import RateLimits
from gateway.state.bus import Fact, StateBus

log = logging.getLogger(__name__)
CONTROL_ROLE = "provider-control"


def control_leads(bus: StateBus) -> Callable[[], bool]:
    """Whether this gateway sends the control loop's heartbeats now (it holds the
    ``provider-control`` role)."""
    return lambda: bus.holds(CONTROL_ROLE)


def share_provider_state(
    bus: StateBus, providers: ProviderPath, control: Control, scale: float = 1.0
) -> None:
    """The other gateways' facts about the providers, applied to ``providers``' book and
    to ``control``; what this gateway holds, republished when the bus's store is back."""
    book = providers.book

    def target(name: str) -> ProviderTarget | None:
        try:
            return providers.target(name)
        except APIError:  # a target this gateway is not configured for
            log.debug("state bus: no target %s here", name)
            return None

    def anchor(f: Fact) -> None:
        learn_anchor(control, f.body, target(str(f.body["target"])))

    bus.on("warm", lambda f: book.learn_warm(f.body, f.elapsed(scale)))
    bus.on("cold", lambda f: book.learn_cold(f.body))
    bus.on("anchor", anchor)
    bus.on("arrival", lambda f: learn_arrival(control, f.body, f.elapsed(scale), True))
    bus.on("touch", lambda f: learn_arrival(control, f.body, f.elapsed(scale), False))
    bus.on("limits", lambda f: learn_limits(control, f.body, f.at))
    bus.on("fan", lambda f: learn_fan(control, f.body))
    bus.snapshot(lambda: [*book.warm_facts(), *anchor_facts(control)])


def share_key_limits(bus: StateBus, limits: RateLimits) -> None:
    """Every gateway's admissions and answers count in every gateway's windows (this
    gateway's go out through the publisher ``limits`` was built with)."""
    bus.on("usage", lambda f: limits.learn(f.body, f.elapsed()))
