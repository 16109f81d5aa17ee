"""Admission control in front of the local replicas: the first thing a request meets.

A request refused here (503 ``queue_full``, with ``Retry-After``) has cost no
tokenizing and left nothing in the session log.  Each priority may find up to
its room of requests in flight (``engine.admission_shares`` of
``engine.max_queued_requests``): when the queue fills, batch is refused
first and interactive last (its share is a reserve beyond the limit).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

from gateway.core.config import PRIORITIES, Priority
from gateway.core.errors import Unavailable
from gateway.core.metrics import Metrics


class Admission:
    def __init__(
        self, max_inflight: int, room: Mapping[Priority, int] | None, metrics: Metrics
    ) -> None:
        # how many requests in flight each priority may find and still be admitted
        self._room = {p: (room or {}).get(p, max_inflight) for p in PRIORITIES}
        self._metrics = metrics
        self.inflight = 0

    @contextlib.contextmanager
    def admit(self, priority: Priority = "default") -> Iterator[None]:
        """Admit one request of ``priority`` or refuse it (see the module); held until the
        request ends."""
        if self.inflight >= self._room[priority]:
            self._metrics.shed.labels(priority).inc()
            whom = "" if priority == "default" else f" for {priority} requests"
            raise Unavailable(
                f"The gateway's request queue is full{whom}; retry shortly",
                code="queue_full",
                retry_after_s=1,
            )
        self.inflight += 1
        try:
            yield
        finally:
            self.inflight -= 1
