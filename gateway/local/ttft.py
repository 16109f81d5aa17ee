"""Where a local request's time to first token went, phase by phase.

The dispatcher stamps when the request reached it, when it was last sent to
the engine and when its first token came back; the engine core stamps when
it queued the request, scheduled it and produced its first token (vLLM's
request stats).  The core's stamps are its ``time.monotonic()`` and ours
``time.perf_counter()``: on Linux both read ``CLOCK_MONOTONIC``, one clock for
every process of a host, so they subtract.  A remote engine reports no
stamps (another host's clock): its request has no phases.

The phases, which add up to the gateway's TTFT (``vcache_ttft_seconds``):

- ``prepare``: arrival to the dispatcher (tokenize, route, the session log);
- ``gate``: room made in the KV cache, the wait for an engine slot in the
  fair gate, and any attempt stopped for a higher class;
- ``submit``: the engine client to the core's waiting queue (the gateway's
  event loop, the client's processing and its IPC);
- ``queue``: in the core's waiting queue;
- ``prefill``: scheduled to the first token (its own prefill steps, with
  whatever else each step computed);
- ``return``: the core's first token to the dispatcher (the core's output
  IPC, the client's output processing, the gateway's event loop).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from engines.base import CoreTimes
from gateway.core.config import Priority

PHASES = ("prepare", "gate", "submit", "queue", "prefill", "return")


@dataclass
class Stamps:
    """One request's stamps on the gateway's side (``time.perf_counter()``)."""

    arrived: float  # the request's t0, before tokenizing
    dispatched: float = 0.0  # the dispatcher's run began
    sent: float = 0.0  # its last attempt was sent to the engine

    def send(self) -> None:
        self.sent = time.perf_counter()

    def phases(self, core: CoreTimes | None, received: float) -> dict[str, float] | None:
        """Seconds per phase (see the module), or None without the core's stamps or when
        the clocks do not agree (a stamp out of order: not this host's clock)."""
        if core is None or not self.sent:
            return None
        points = (
            self.arrived,
            self.dispatched,
            self.sent,
            core.queued_s,
            core.scheduled_s,
            core.first_token_s,
            received,
        )
        if any(b < a for a, b in itertools.pairwise(points)):
            return None
        return {p: b - a for p, (a, b) in zip(PHASES, itertools.pairwise(points), strict=True)}


def priority_class(priority: int) -> Priority:
    """The class an engine priority stands for (lower first), for a metric's label."""
    return "interactive" if priority < 0 else "batch" if priority > 0 else "default"
