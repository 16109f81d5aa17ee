"""The local replicas and their readiness: one :class:`ReplicaSet`, built once by the
composition root (``gateway/app.py``) and handed to the supervisor, which writes it,
and to the dispatcher and the local chat, which read it.

What it holds: the replicas (the supervisor swaps a restarted replica's engine),
each one's :class:`ReplicaHealth`, and the outcome of the boot: the exact KV spans
attached then (None: no replica publishes KV events), whether every replica
started, or why they could not.  The supervisor changes it through
:meth:`ReplicaSet.booted`, :meth:`ReplicaSet.boot_failed` and
:meth:`ReplicaSet.swap`; nothing else writes it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from engines.base import Engine
from gateway.local.replicas import Replica
from gateway.local.spans import KVSpans
from manifest.index import LocationId

ReplicaState = Literal["starting", "ready", "dead", "restarting", "failed"]


@dataclass
class ReplicaHealth:
    state: ReplicaState = "starting"
    restarts: int = 0  # successful restarts since boot
    failures: int = 0  # consecutive failed restart attempts
    last_error: str | None = None
    next_attempt_at: float | None = None  # monotonic time of the next restart attempt


class ReplicaSet:
    def __init__(
        self, replicas: Sequence[Replica], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.replicas = list(replicas)
        self.clock = clock  # the supervisor's clock: restart attempts are due on it
        self.health: dict[LocationId, ReplicaHealth] = {r.id: ReplicaHealth() for r in replicas}
        self._kv: KVSpans | None = None
        self._started = False
        self._failed: str | None = None

    # ------------------------------------------------------------- view

    @property
    def kv(self) -> KVSpans | None:
        """The exact KV spans over the replicas that publish KV events (None: none does,
        or the boot has not attached them yet)."""
        return self._kv

    @property
    def started(self) -> bool:
        """Every replica started (and the spans probed)."""
        return self._started

    @property
    def failed(self) -> str | None:
        """Why the replicas could not start at boot (requests are refused with it)."""
        return self._failed

    def serving(self) -> list[Replica]:
        """The replicas that can take a request now (a dead one is being restarted)."""
        return [r for r in self.replicas if r.engine.ready]

    def replica(self, replica_id: str) -> Replica | None:
        return next((r for r in self.replicas if r.id == replica_id), None)

    @property
    def engine_dead(self) -> bool:
        """Every local replica has died after boot (none can serve until one restarts)."""
        return bool(self.health) and all(
            h.state in ("dead", "restarting") for h in self.health.values()
        )

    def retry_after_s(self) -> float:
        """How long until a dead local engine may serve again (at least 1 s): the next
        restart attempt, or the end of the one under way (as long as a boot start took)."""
        at = [h.next_attempt_at for h in self.health.values() if h.next_attempt_at is not None]
        return max(1.0, min(at) - self.clock()) if at else 5.0

    # ----------------------------------------------- the supervisor's writes

    def booted(self, kv: KVSpans | None) -> None:
        """Every replica started; ``kv``: the spans attached to them (None: none)."""
        self._kv = kv
        self._started = True

    def boot_failed(self, why: str) -> None:
        """The boot failed (final: a bad model path or a bad config)."""
        self._failed = why
        for h in self.health.values():
            h.state = "failed"

    def swap(self, replica_id: LocationId, engine: Engine) -> None:
        """``replica_id`` serves from ``engine`` now (a restart)."""
        r = self.replica(replica_id)
        if r is None:
            raise KeyError(replica_id)
        r.engine = engine
