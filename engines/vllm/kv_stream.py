"""A replica's KV-event stream without its sockets: the wire types, and the ordering
rules (sans-I/O, so they are tested by feeding messages, with no sleeps).

vLLM publishes multipart messages ``(topic, seq: 8 bytes big-endian,
payload)``; the payload is an array-like ``EventBatch`` ``[ts, events,
dp_rank]`` whose events are maps tagged by ``type``.  We decode by field
name and ignore fields we do not know, so newer vLLM versions keep working;
of an event we decode only what the index folds, its block hashes (a stored
block's token ids, 128 a block, are skipped unread, not built as lists).

:class:`EventSequence` checks every message's sequence number.  The next one
is applied; a gap (dropped messages, a late join) asks for a repair from the
publisher's replay buffer, holding what arrives meanwhile; a sequence that
goes back (the engine restarted) asks for a full resync.  The replay and the
live stream are two sockets: a batch sent while the replay was on its way can
come both ways, live after the replay applied it; that copy (the same sequence
number and bytes) is dropped, not taken for a restart.  The subscriber
(:mod:`engines.vllm.kv_events`) does the I/O each answer calls for.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

log = logging.getLogger(__name__)

FULL_RESYNC = -1  # a repair no replay can make

BlockKey = bytes | int


class BlockStored(msgspec.Struct, tag=True, gc=False):
    block_hashes: list[BlockKey]


class BlockRemoved(msgspec.Struct, tag=True, gc=False):
    block_hashes: list[BlockKey]


class AllBlocksCleared(msgspec.Struct, tag=True, gc=False):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, gc=False):
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
    duplicates: int = 0  # live copies of batches a replay had applied
    last_seq: int | None = None
    errors: list[str] = field(default_factory=list)


class EventSequence:
    """The ordering rules of one replica's stream; decoded batches go to ``apply``."""

    def __init__(self, apply: Callable[[EventBatch], None]) -> None:
        self._apply = apply
        self.repair_from: int | None = None  # FULL_RESYNC, or the first missing sequence
        self._held: list[tuple[int, bytes]] = []
        self._resync_to: int | None = None
        # what the last replay applied, until the live stream has passed it
        self._replayed: dict[int, bytes] = {}
        self.stats = SubscriberStats()

    @property
    def repair_pending(self) -> bool:
        return self.repair_from is not None

    def _expected(self) -> int:
        last = self.stats.last_seq
        return 0 if last is None else last + 1

    def receive(self, seq: int, payload: bytes) -> None:
        """One message from the stream, in arrival order."""
        if self.repair_from is not None:
            self._held.append((seq, payload))  # applied after the repair, in order
            return
        last, expected = self.stats.last_seq, self._expected()
        if seq == expected:
            self._replayed.clear()  # the live stream is past the replay: no copy follows
            self._accept(seq, payload)
            return
        if self._replayed.get(seq) == payload:
            self.stats.duplicates += 1  # sent while the replay was on its way: applied
            return
        self.stats.gaps += 1
        self._held.append((seq, payload))
        if last is not None and seq <= last:
            log.warning("KV event sequence restarted (%d after %d): resyncing", seq, last)
            self.repair_from = FULL_RESYNC
        else:
            log.warning("KV event gap: expected %d, got %d", expected, seq)
            self.repair_from = expected

    def _accept(self, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except msgspec.DecodeError as exc:
            self.stats.errors.append(f"seq {seq}: {exc}")
            return
        self._apply(batch)
        self.stats.batches += 1
        self.stats.last_seq = seq

    def replayed(self, batches: list[tuple[int, bytes]] | None) -> bool:
        """End a repair with the publisher's replay (None: it could not cover the gap),
        merged with what was held meanwhile.  True when the stream is whole again; False
        when the owner must resync fully, then call :meth:`resynced`."""
        held, self._held = self._held, []
        self.repair_from = None
        if batches is not None:
            self.stats.replays += 1
            merged = dict(batches)
            merged.update(held)
            for seq in sorted(merged):
                expected = self._expected()
                if seq < expected:
                    continue
                if seq > expected:
                    break  # still a hole: a full resync
                self._accept(seq, merged[seq])
                self._replayed[seq] = merged[seq]
            else:
                return True
        self._resync_to = max((s for s, _ in held), default=self.stats.last_seq)
        return False

    def resynced(self) -> None:
        """The owner rebuilt the index from the engine: it reflects the engine now, and
        later batches still apply in order."""
        self.stats.resyncs += 1
        self.stats.last_seq = self._resync_to
        self._replayed.clear()
