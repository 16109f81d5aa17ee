"""Our KV-event subscriber against vLLM's own ZMQ publisher: decode, gaps, replay, restarts."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import pytest

from engines.vllm.kv_events import EventBatch, KVEventSubscriber, decode_batch

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
    def __init__(self) -> None:
        self.blocks: set[int] = set()
        self.resyncs = 0

    def apply(self, b: EventBatch) -> None:
        from engines.vllm.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        for e in b.events:
            if isinstance(e, BlockStored):
                self.blocks |= {int(h) for h in e.block_hashes}
            elif isinstance(e, BlockRemoved):
                self.blocks -= {int(h) for h in e.block_hashes}
            elif isinstance(e, AllBlocksCleared):
                self.blocks.clear()

    async def resync(self) -> None:
        self.resyncs += 1
        self.blocks = {999}  # what "the engine" reports now


def endpoints(tmp_path: Path) -> tuple[str, str]:
    n = next(_ids)
    return f"ipc://{tmp_path}/ev{n}", f"ipc://{tmp_path}/rp{n}"


def publisher(ev: str, rp: str, buffer_steps: int = 100) -> Any:
    return kv_events.ZmqEventPublisher(
        data_parallel_rank=0, endpoint=ev, replay_endpoint=rp, buffer_steps=buffer_steps
    )


async def settle(sub: KVEventSubscriber, cond: Any, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, sub.stats
        await sub.sync()
        await asyncio.sleep(0.01)


def test_decode_ignores_unknown_fields() -> None:
    import msgspec

    payload = msgspec.msgpack.encode(batch(stored(1, 2), kv_events.BlockRemoved([1], "GPU")))
    b = decode_batch(payload)
    assert [type(e).__name__ for e in b.events] == ["BlockStored", "BlockRemoved"]
    assert b.events[0].block_hashes == [1, 2]  # type: ignore[union-attr]


def test_in_order_stream_then_a_late_join_is_replayed(tmp_path: Path) -> None:
    async def main() -> None:
        ev, rp = endpoints(tmp_path)
        pub = publisher(ev, rp)
        try:
            pub.publish(batch(stored(1)))  # before anyone subscribed: lost on PUB
            pub.publish(batch(stored(2)))
            await asyncio.sleep(0.3)
            sink = Sink()
            sub = KVEventSubscriber(ev, rp, sink.apply, sink.resync)
            await asyncio.sleep(0.3)  # let the SUB connect
            pub.publish(batch(stored(3)))
            await settle(sub, lambda: sink.blocks == {1, 2, 3})
            assert (sub.stats.gaps, sub.stats.replays, sub.stats.resyncs) == (1, 1, 0)
            pub.publish(batch(kv_events.BlockRemoved([2], "GPU")))
            await settle(sub, lambda: sink.blocks == {1, 3})
            assert sub.stats.last_seq == 3
            sub.close()
        finally:
            pub.shutdown()

    asyncio.run(main())


def test_sequence_restart_forces_a_resync(tmp_path: Path) -> None:
    async def main() -> None:
        ev, rp = endpoints(tmp_path)
        sink = Sink()
        sub = KVEventSubscriber(ev, rp, sink.apply, sink.resync)
        pub = publisher(ev, rp)
        await asyncio.sleep(0.3)
        for h in (1, 2, 3):
            pub.publish(batch(stored(h)))
        await settle(sub, lambda: sink.blocks == {1, 2, 3})
        pub.shutdown()  # the engine restarts: a new publisher counts from 0 again
        pub = publisher(ev, rp)
        try:
            for _ in range(50):  # the SUB reconnects on its own; keep the engine talking
                pub.publish(batch(stored(7)))
                await asyncio.sleep(0.1)
                await sub.sync()
                if sink.resyncs:
                    break
            assert sink.resyncs == 1
            assert sink.blocks == {999}  # rebuilt from the engine, not trusted from the stream
            pub.publish(batch(stored(8)))
            await settle(sub, lambda: 8 in sink.blocks)
            sub.close()
        finally:
            pub.shutdown()

    asyncio.run(main())


def test_gap_beyond_the_replay_buffer_forces_a_resync(tmp_path: Path) -> None:
    async def main() -> None:
        ev, rp = endpoints(tmp_path)
        pub = publisher(ev, rp, buffer_steps=2)
        try:
            for h in range(5):  # seq 0..4 sent before the subscriber exists; buffer keeps 3, 4
                pub.publish(batch(stored(h)))
            await asyncio.sleep(0.3)
            sink = Sink()
            sub = KVEventSubscriber(ev, rp, sink.apply, sink.resync)
            await asyncio.sleep(0.3)
            pub.publish(batch(stored(5)))
            await settle(sub, lambda: sink.resyncs == 1)
            assert sub.stats.replays == 0 and sink.blocks == {999}
            pub.publish(batch(stored(6)))
            await settle(sub, lambda: 6 in sink.blocks)
            sub.close()
        finally:
            pub.shutdown()

    asyncio.run(main())
