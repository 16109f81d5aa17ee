"""Subscriber to a vLLM replica's KV events: the sockets around
:class:`~engines.vllm.kv_stream.EventSequence` (ZMQ SUB for the stream, a DEALER
for the publisher's replay endpoint).

A gap is repaired from the replay endpoint; if the replay buffer no longer
covers it, or the sequence restarts (engine restart), the owner is asked for
a full resync.  A stale index is never trusted silently.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio

from engines.vllm.kv_stream import (
    FULL_RESYNC,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventSequence,
    KVEvent,
    SubscriberStats,
    decode_batch,
)

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KVEvent",
    "KVEventSubscriber",
    "SubscriberStats",
    "decode_batch",
]

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVEventSubscriber:
    """Reads one replica's events and hands decoded batches to ``apply``.

    ``resync`` is awaited when the stream cannot be repaired: the owner
    rebuilds that replica's index from the engine itself.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        apply: Callable[[EventBatch], None],
        resync: Callable[[], Awaitable[None]],
        topic: str = "",
        replay_timeout_s: float = 2.0,
    ) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._sock.subscribe(topic.encode())
        self._sync: zmq.Socket[bytes] = zmq.Socket.shadow(self._sock.underlying)
        self._replay_endpoint = replay_endpoint
        self._resync = resync
        self._replay_timeout_s = replay_timeout_s
        self.sequence = EventSequence(apply)

    @property
    def stats(self) -> SubscriberStats:
        return self.sequence.stats

    @property
    def repair_pending(self) -> bool:
        return self.sequence.repair_pending

    # --------------------------------------------------------------- intake

    def read_available(self) -> int:
        """Handle every message already received, without waiting.  Returns the count."""
        n = 0
        while True:
            try:
                frames = self._sync.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return n
            n += 1
            if len(frames) != 3:
                continue
            self.sequence.receive(int.from_bytes(frames[1], "big"), frames[2])

    # --------------------------------------------------------------- repair

    async def _replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """Ask the publisher for batches from ``start``; None if it cannot cover them."""
        if self._replay_endpoint is None:
            return None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self._replay_endpoint)
        got: list[tuple[int, bytes]] = []
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await dealer.poll(int(self._replay_timeout_s * 1000)):
                    return None
                frames = await dealer.recv_multipart()
                if len(frames) < 4 or frames[2] == END_SEQ:
                    break
                got.append((int.from_bytes(frames[2], "big"), frames[3]))
        finally:
            dealer.close()
        if not got or got[0][0] != start:
            return None
        return got

    async def repair(self) -> None:
        start = self.sequence.repair_from
        if start is None:
            return
        replayed = await self._replay(start) if start != FULL_RESYNC else None
        if not self.sequence.replayed(replayed):
            await self._resync()
            self.sequence.resynced()

    # ----------------------------------------------------------------- loop

    async def run(self) -> None:
        while True:
            await self._sock.poll()
            self.read_available()
            if self.repair_pending:
                await self.repair()

    async def sync(self) -> None:
        """Bring the index up to date with everything this process has received of the
        replica's stream so far (ZMQ's I/O thread holds it: it is read without a turn
        of the event loop, which under load is a wait of milliseconds)."""
        self.read_available()
        if self.repair_pending:
            await self.repair()

    async def wait_for(self, seq: int, timeout_s: float = 2.0) -> bool:
        """Fold messages until batch ``seq`` has been applied; False on timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            await self.sync()
            last = self.stats.last_seq
            if seq < 0 or (last is not None and last >= seq):
                return True
            if loop.time() > deadline:
                return False
            await asyncio.sleep(0.002)

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()
