"""Room in a replica's KV for a request: asked before it starts, and again while it waits
for its first token.

vLLM cannot start a request it has no blocks for, and pinned blocks are not its
to take.  ``MakeRoom`` (``SessionTurns.make_room``, set by the local chat
service) releases session leases on the replica until the request fits.  Sessions
lease blocks at their turns' ends while a request waits in vLLM's queue, so the
request asks again every :data:`ROOM_CHECK_S` until its first token.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from engines.errors import EngineError
from gateway.local.spans import KVSpans
from manifest.hashing import BlockHash
from manifest.index import LocationId

log = logging.getLogger(__name__)

MakeRoom = Callable[[KVSpans, LocationId, Sequence[BlockHash], int], Awaitable[int]]
ROOM_CHECK_S = 1.0  # how often a request waiting for its first token asks for room again


class RoomKeeper:
    """Asks for a request's room every :data:`ROOM_CHECK_S` until cancelled (at the
    request's first token, or its end).  Until the first check is due it is one timer,
    no task: most requests have their first token long before."""

    def __init__(
        self,
        make_room: MakeRoom,
        kv: KVSpans,
        replica: LocationId,
        hashes: Sequence[BlockHash],
        need: int,
        name: str,
    ) -> None:
        self._ask = make_room, kv, replica, hashes, need
        self._name = name
        self._task: asyncio.Task[None] | None = None
        self._timer = asyncio.get_running_loop().call_later(ROOM_CHECK_S, self._start)

    def _start(self) -> None:
        self._task = asyncio.create_task(self._keep(), name=f"room for {self._name}")

    async def _keep(self) -> None:
        make_room, kv, replica, hashes, need = self._ask
        while True:
            try:
                await make_room(kv, replica, hashes, need)
            except EngineError as exc:  # the request fails or goes on by itself
                log.debug("replica %s: no room made (%s)", replica, exc)
            await asyncio.sleep(ROOM_CHECK_S)

    def cancel(self) -> None:
        self._timer.cancel()
        if self._task is not None:
            self._task.cancel()
