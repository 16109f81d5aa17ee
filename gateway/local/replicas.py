"""A replica of the local model: one engine (embedded vLLM, or a remote vLLM server the
gateway controls), the KV-event sockets it publishes on, and how to build a fresh
engine when this one dies.  The supervisor swaps ``engine`` on a restart; the
dispatcher counts ``inflight``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engines.base import Engine
from manifest.index import LocationId


@dataclass
class Replica:
    id: LocationId
    engine: Engine
    events_endpoint: str | None = None  # None: no KV events (no exact spans)
    replay_endpoint: str | None = None
    factory: Callable[[], Engine] | None = None  # None: cannot be restarted
    inflight: int = 0
    # the compute it shares with the replicas of the same name ("host": the embedded
    # replicas of a CPU host); their first-token guards act together (local/fairness.py)
    shares: str | None = None
