"""The KV-event stream's ordering rules, fed message by message (no sockets, no sleeps)."""

from __future__ import annotations

import msgspec

from engines.vllm.kv_stream import FULL_RESYNC, BlockStored, EventBatch, EventSequence


def msg(*hashes: int) -> bytes:
    return msgspec.msgpack.encode(EventBatch(ts=1.0, events=[BlockStored(list(hashes))]))


class Sink:
    def __init__(self) -> None:
        self.applied: list[int] = []

    def __call__(self, batch: EventBatch) -> None:
        for e in batch.events:
            assert isinstance(e, BlockStored)
            self.applied += [int(h) for h in e.block_hashes]


def test_in_order_messages_apply_at_once() -> None:
    sink = Sink()
    s = EventSequence(sink)
    for seq in range(3):
        s.receive(seq, msg(seq))
    assert sink.applied == [0, 1, 2]
    assert (s.stats.batches, s.stats.last_seq, s.repair_pending) == (3, 2, False)


def test_a_gap_asks_for_a_replay_and_holds_what_arrives_meanwhile() -> None:
    sink = Sink()
    s = EventSequence(sink)
    s.receive(0, msg(0))
    s.receive(3, msg(3))  # 1 and 2 were dropped
    assert s.repair_from == 1 and s.stats.gaps == 1
    s.receive(4, msg(4))  # held, not applied out of order
    assert sink.applied == [0]
    assert s.replayed([(1, msg(1)), (2, msg(2)), (3, msg(3))]) is True
    assert sink.applied == [0, 1, 2, 3, 4]
    assert (s.stats.replays, s.stats.last_seq, s.repair_pending) == (1, 4, False)


def test_a_batch_that_came_by_the_replay_and_then_live_is_applied_once() -> None:
    """The replay and the stream are two sockets: a batch sent while the replay was on
    its way comes both ways, the live copy after the replay applied it.  It is the same
    batch, not an engine that restarted."""
    sink = Sink()
    s = EventSequence(sink)
    s.receive(2, msg(2))  # a late join: 0 and 1 missed
    assert s.replayed([(0, msg(0)), (1, msg(1)), (2, msg(2)), (3, msg(3))]) is True
    s.receive(3, msg(3))  # 3's live copy, read after the replay
    assert not s.repair_pending and s.stats.resyncs == 0
    assert (s.stats.duplicates, s.stats.last_seq) == (1, 3)
    s.receive(4, msg(4))
    assert sink.applied == [0, 1, 2, 3, 4]
    s.receive(3, msg(3))  # past the replay: a sequence that goes back is a restart again
    assert s.repair_from == FULL_RESYNC


def test_a_restart_right_after_a_replay_is_still_a_restart() -> None:
    sink = Sink()
    s = EventSequence(sink)
    s.receive(2, msg(2))
    assert s.replayed([(0, msg(0)), (1, msg(1)), (2, msg(2))]) is True
    s.receive(0, msg(100))  # the restarted engine's first batch: other bytes
    assert s.repair_from == FULL_RESYNC and s.stats.duplicates == 0


def test_a_replay_that_does_not_cover_the_gap_needs_a_full_resync() -> None:
    sink = Sink()
    s = EventSequence(sink)
    s.receive(0, msg(0))
    s.receive(5, msg(5))
    assert s.replayed([(3, msg(3))]) is False  # 1 and 2 are gone from the buffer
    s.resynced()
    assert sink.applied == [0]  # nothing applied across the hole
    assert (s.stats.resyncs, s.stats.last_seq) == (1, 5)  # the engine's state covers 5
    s.receive(6, msg(6))
    assert sink.applied == [0, 6]


def test_no_replay_endpoint_means_a_full_resync() -> None:
    s = EventSequence(Sink())
    s.receive(2, msg(2))  # a late join
    assert s.repair_from == 0
    assert s.replayed(None) is False
    s.resynced()
    assert s.stats.last_seq == 2


def test_a_sequence_that_goes_back_is_an_engine_restart() -> None:
    sink = Sink()
    s = EventSequence(sink)
    for seq in range(4):
        s.receive(seq, msg(seq))
    s.receive(0, msg(100))  # the restarted engine counts from 0 again
    assert s.repair_from == FULL_RESYNC
    assert s.replayed(None) is False
    s.resynced()
    assert s.stats.last_seq == 0
    s.receive(1, msg(101))
    assert sink.applied == [0, 1, 2, 3, 101]  # the batch that told of the restart: not applied


def test_an_undecodable_batch_is_recorded_and_skipped() -> None:
    sink = Sink()
    s = EventSequence(sink)
    s.receive(0, b"\xc1not msgpack")
    assert s.stats.errors and s.stats.last_seq is None
    s.receive(0, msg(7))
    assert sink.applied == [7]
