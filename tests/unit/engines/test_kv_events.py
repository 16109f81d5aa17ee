"""Our KV-event subscriber against vLLM's own ZMQ publisher: decode, gaps, replay, restarts.

Over Unix sockets in this process, ordered by what was sent and applied, never by
sleeping: a publish returns once the batch is sent (the plugin's ``in_order``), the
subscriber's side is awaited batch by batch, and ZMQ's slow joiner is met by probing."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from engines.vllm.kv_events import EventBatch, KVEventSubscriber, decode_batch
from engines.vllm.plugin import in_order

kv_events = pytest.importorskip("vllm.distributed.kv_events")

_ids = itertools.count()


def stored(*hashes: int) -> Any:
    return kv_events.BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=None,
        token_ids=[1, 2],
        block_size=2,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


def batch(*events: Any) -> Any:
    return kv_events.KVEventBatch(ts=1.0, events=list(events))


class Sink:
    """What the subscriber applied; ``changed`` is set on every batch and resync."""

    def __init__(self) -> None:
        self.blocks: set[int] = set()
        self.resyncs = 0
        self.changed = asyncio.Event()

    def apply(self, b: EventBatch) -> None:
        from engines.vllm.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        for e in b.events:
            if isinstance(e, BlockStored):
                self.blocks |= {int(h) for h in e.block_hashes}
            elif isinstance(e, BlockRemoved):
                self.blocks -= {int(h) for h in e.block_hashes}
            elif isinstance(e, AllBlocksCleared):
                self.blocks.clear()
        self.changed.set()

    async def resync(self) -> None:
        self.resyncs += 1
        self.blocks = {999}  # what "the engine" reports now
        self.changed.set()

    async def until(self, cond: Callable[[], bool], timeout_s: float = 5.0) -> bool:
        """Wait for the subscriber's batches (or resyncs) until ``cond()`` holds; False
        at the deadline."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not cond():
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), deadline - loop.time())
            except TimeoutError:
                return cond()
        return True


def endpoints(tmp_path: Path) -> tuple[str, str]:
    n = next(_ids)
    return f"ipc://{tmp_path}/ev{n}", f"ipc://{tmp_path}/rp{n}"


def publisher(ev: str, rp: str, buffer_steps: int = 100) -> Any:
    return kv_events.ZmqEventPublisher(
        data_parallel_rank=0, endpoint=ev, replay_endpoint=rp, buffer_steps=buffer_steps
    )


# vLLM's publish, returning once its sender thread has sent the batch (the plugin's):
# what is sent before a subscriber exists is lost on PUB, not merely late
send = in_order(kv_events.ZmqEventPublisher.publish, timeout_s=10.0)


@contextlib.asynccontextmanager
async def subscribed(ev: str, rp: str, sink: Sink) -> AsyncIterator[KVEventSubscriber]:
    """A subscriber reading as the gateway's does (its ``run`` loop: read, repair)."""
    sub = KVEventSubscriber(ev, rp, sink.apply, sink.resync)
    reader = asyncio.create_task(sub.run())
    try:
        yield sub
    finally:
        reader.cancel()
        await asyncio.wait({reader})
        sub.close()


PROBES = 200  # at most, 0.05 s apart


async def probe(pub: Any, message: Any, sink: Sink, cond: Callable[[], bool]) -> int:
    """Send ``message`` until ``cond()`` holds on the subscriber's side: a SUB that
    connected a moment ago misses what the PUB sends before its subscription reached
    the PUB (ZMQ's slow joiner), and no event says when it has.  Each probe is waited
    for briefly, then sent again; returns how many were sent."""
    for n in range(1, PROBES + 1):
        send(pub, message)
        if await sink.until(cond, timeout_s=0.05):
            return n
    raise AssertionError(f"the subscriber never joined ({PROBES} probes)")


def test_decode_ignores_unknown_fields() -> None:
    import msgspec

    payload = msgspec.msgpack.encode(batch(stored(1, 2), kv_events.BlockRemoved([1], "GPU")))
    b = decode_batch(payload)
    assert [type(e).__name__ for e in b.events] == ["BlockStored", "BlockRemoved"]
    assert b.events[0].block_hashes == [1, 2]  # type: ignore[union-attr]


def test_a_sync_reads_without_a_turn_of_the_event_loop(tmp_path: Path) -> None:
    """Routing syncs every replica's stream before each request: what ZMQ's I/O thread
    has received is read at once, not after every callback already queued on a busy
    loop (a sleep(0) did that: a wait of milliseconds under load, per replica)."""

    async def main() -> None:
        sink = Sink()
        ev, rp = endpoints(tmp_path)
        sub = KVEventSubscriber(ev, rp, sink.apply, sink.resync)
        queued: list[int] = []
        asyncio.get_running_loop().call_soon(queued.append, 1)
        await sub.sync()
        assert queued == []  # the callback queued before the sync has not run yet
        sub.close()

    asyncio.run(main())


def test_in_order_stream_then_a_late_join_is_replayed(tmp_path: Path) -> None:
    async def main() -> None:
        ev, rp = endpoints(tmp_path)
        pub = publisher(ev, rp)
        try:
            send(pub, batch(stored(1)))  # before anyone subscribed: lost on PUB
            send(pub, batch(stored(2)))
            sink = Sink()
            async with subscribed(ev, rp, sink) as sub:
                probes = await probe(pub, batch(stored(3)), sink, lambda: sink.blocks == {1, 2, 3})
                assert (sub.stats.gaps, sub.stats.replays, sub.stats.resyncs) == (1, 1, 0)
                send(pub, batch(kv_events.BlockRemoved([2], "GPU")))
                assert await sink.until(lambda: sink.blocks == {1, 3})
                assert sub.stats.last_seq == 2 + probes  # 0, 1 lost; the probes; the removal
        finally:
            pub.shutdown()

    asyncio.run(main())


def test_sequence_restart_forces_a_resync(tmp_path: Path) -> None:
    async def main() -> None:
        ev, rp = endpoints(tmp_path)
        sink = Sink()
        async with subscribed(ev, rp, sink) as sub:
            pub = publisher(ev, rp)
            try:
                await probe(pub, batch(stored(1)), sink, lambda: 1 in sink.blocks)
                for h in (2, 3):
                    send(pub, batch(stored(h)))
                # the engine ran a while: the restarted one's probes, counted from 0 again,
                # all go back (however many the SUB's reconnection misses)
                for _ in range(PROBES):
                    send(pub, batch(stored(3)))
                assert await sink.until(
                    lambda: sink.blocks == {1, 2, 3} and (sub.stats.last_seq or 0) >= PROBES
                )
            finally:
                pub.shutdown()  # the engine restarts: a new publisher counts from 0 again
            pub = publisher(ev, rp)
            try:
                # the SUB reconnects on its own; the engine talks until it has (batches
                # with no events: however many it takes, they change no block)
                await probe(pub, batch(), sink, lambda: sink.resyncs > 0)
                assert sink.resyncs == 1
                assert sink.blocks == {999}  # rebuilt from the engine, not trusted from the stream
                send(pub, batch(stored(8)))
                assert await sink.until(lambda: 8 in sink.blocks)
            finally:
                pub.shutdown()

    asyncio.run(main())


def test_gap_beyond_the_replay_buffer_forces_a_resync(tmp_path: Path) -> None:
    async def main() -> None:
        ev, rp = endpoints(tmp_path)
        pub = publisher(ev, rp, buffer_steps=2)
        try:
            for h in range(5):  # seq 0..4 sent before the subscriber exists; buffer keeps 3, 4
                send(pub, batch(stored(h)))
            sink = Sink()
            async with subscribed(ev, rp, sink) as sub:
                # the first batch it gets is past what the buffer still holds (batches with no
                # events: however many the join takes, they change no block)
                await probe(pub, batch(), sink, lambda: sink.resyncs == 1)
                assert sub.stats.replays == 0 and sink.blocks == {999}
                send(pub, batch(stored(6)))
                assert await sink.until(lambda: 6 in sink.blocks)
        finally:
            pub.shutdown()

    asyncio.run(main())
