"""Subscriber to a vLLM replica's KV events (ZMQ PUB, msgspec msgpack).

vLLM publishes multipart messages ``(topic, seq: 8 bytes big-endian,
payload)``; the payload is an array-like ``EventBatch`` ``[ts, events,
dp_rank]`` whose events are maps tagged by ``type``.  We decode by field
name and ignore fields we do not know, so newer vLLM versions keep working.

Every message's sequence number is checked.  A gap (dropped messages, a
late join) is repaired from the publisher's replay endpoint; if the replay
buffer no longer covers it, or the sequence restarts (engine restart), the
owner is asked for a full resync.  A stale index is never trusted silently.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)

BlockKey = bytes | int


class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[BlockKey]
    parent_block_hash: BlockKey | None = None
    token_ids: list[int] = msgspec.field(default_factory=list)
    block_size: int = 0


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[BlockKey]


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(EventBatch)


def decode_batch(payload: bytes) -> EventBatch:
    return _decoder.decode(payload)


@dataclass
class SubscriberStats:
    batches: int = 0
    gaps: int = 0
    replays: int = 0
    resyncs: int = 0
    last_seq: int | None = None
    errors: list[str] = field(default_factory=list)


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
        self._apply = apply
        self._resync = resync
        self._replay_timeout_s = replay_timeout_s
        self._repair_from: int | None = None
        self._held: list[tuple[int, bytes]] = []
        self.stats = SubscriberStats()

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
            self._on_message(int.from_bytes(frames[1], "big"), frames[2])

    def _on_message(self, seq: int, payload: bytes) -> None:
        if self._repair_from is not None:
            self._held.append((seq, payload))  # applied after the repair, in order
            return
        last = self.stats.last_seq
        expected = 0 if last is None else last + 1
        if seq == expected:
            self._accept(seq, payload)
        elif last is not None and seq <= last:
            log.warning("KV event sequence restarted (%d after %d): resyncing", seq, last)
            self.stats.gaps += 1
            self._repair_from = -1  # -1: no replay possible, full resync
            self._held.append((seq, payload))
        else:
            log.warning("KV event gap: expected %d, got %d", expected, seq)
            self.stats.gaps += 1
            self._repair_from = expected
            self._held.append((seq, payload))

    def _accept(self, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except msgspec.DecodeError as exc:
            self.stats.errors.append(f"seq {seq}: {exc}")
            return
        self._apply(batch)
        self.stats.batches += 1
        self.stats.last_seq = seq

    @property
    def repair_pending(self) -> bool:
        return self._repair_from is not None

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
        start = self._repair_from
        if start is None:
            return
        replayed = await self._replay(start) if start >= 0 else None
        held, self._held = self._held, []
        self._repair_from = None
        if replayed is not None:
            self.stats.replays += 1
            merged = dict(replayed)
            merged.update(held)
            for seq in sorted(merged):
                last = self.stats.last_seq
                expected = 0 if last is None else last + 1
                if seq < expected:
                    continue
                if seq > expected:
                    break  # still a hole: fall through to a full resync
                self._accept(seq, merged[seq])
            else:
                return
        self.stats.resyncs += 1
        await self._resync()
        # The resync reflects the engine now; later batches still apply in order.
        self.stats.last_seq = max((s for s, _ in held), default=self.stats.last_seq)

    # ----------------------------------------------------------------- loop

    async def run(self) -> None:
        while True:
            await self._sock.poll()
            self.read_available()
            if self.repair_pending:
                await self.repair()

    async def sync(self) -> None:
        """Bring the index up to date with everything the replica has published so far."""
        await asyncio.sleep(0)
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
