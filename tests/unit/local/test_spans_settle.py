"""Events before answers: a prediction right after an answer sees that answer's blocks.

The engine sends a step's KV events before its outputs (the plugin's ``in_order``
publish), and the gateway's dispatch-time sync waits for events still in transit
when a prompt the engine already answered is missing from the index.
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import pytest

from engines.vllm.plugin import in_order
from gateway.local.spans import KVSpans
from manifest.hashing import BlockHash, block_hashes, event_hash
from manifest.index import LocationId

kv_events = pytest.importorskip("vllm.distributed.kv_events")

R = LocationId("replica-0")
_ids = itertools.count()


def _stored(hashes: list[BlockHash]) -> Any:
    return kv_events.KVEventBatch(
        ts=1.0,
        events=[
            kv_events.BlockStored(
                block_hashes=[event_hash(h) for h in hashes],
                parent_block_hash=None,
                token_ids=[1, 2],
                block_size=16,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            )
        ],
    )


class InTransitCore:
    """An engine core whose last batch is still in its publisher's queue: the barrier
    (as the plugin's) sends it, then answers with its sequence number."""

    def __init__(self, publisher: Any) -> None:
        self.publisher = publisher
        self.held: list[Any] = []
        self.sent = -1
        self.calls: list[str] = []

    async def call_core(self, method: str, *args: Any) -> Any:
        self.calls.append(method)
        assert method == "vcache_events_barrier", method
        for b in self.held:
            self.publisher.publish(b)
            self.sent += 1
        self.held.clear()
        return self.sent

    def generate(self, request: Any) -> Any:
        raise AssertionError("not used")


def _manager(tmp_path: Path) -> tuple[KVSpans, InTransitCore, Any, list[BlockHash]]:
    n = next(_ids)
    ev, rp = f"ipc://{tmp_path}/ev{n}", f"ipc://{tmp_path}/rp{n}"
    pub = kv_events.ZmqEventPublisher(data_parallel_rank=0, endpoint=ev, replay_endpoint=rp)
    kv = KVSpans(16, "0", pin_max_share=0.5, default_lease_s=60)
    core = InTransitCore(pub)
    kv.attach(R, core, ev, rp)
    return kv, core, pub, block_hashes(list(range(64)), 16, "0")


async def _connected(kv: KVSpans, core: InTransitCore, hashes: list[BlockHash]) -> None:
    """Publish until the subscriber has joined (PUB drops messages before that): each
    probe is awaited until it is applied, or briefly, then sent again."""
    subscriber = kv.state(R).subscriber
    for _ in range(100):
        core.publisher.publish(_stored(hashes[:1]))
        core.sent += 1
        await subscriber.wait_for(core.sent - 1, timeout_s=0.05)
        if kv.index.match(hashes[:1])[R]:
            return
    raise AssertionError("subscriber never connected")


def test_a_prompt_answered_before_its_events_arrived_waits_for_them(tmp_path: Path) -> None:
    async def main() -> None:
        kv, core, pub, hashes = _manager(tmp_path)
        try:
            await _connected(kv, core, hashes)
            core.held.append(_stored(hashes[1:4]))  # the answer came, its events have not
            kv.answered(R, hashes[:4])
            assert kv.index.match(hashes[:4])[R] == 1
            await kv.sync()
            assert kv.index.match(hashes[:4])[R] == 4  # predicted against the stored blocks
            assert core.calls == ["vcache_events_barrier"]
            assert kv.state(R).late_event_waits == 1
            await kv.sync()  # nothing answered since: no engine round trip
            assert core.calls == ["vcache_events_barrier"]
        finally:
            await kv.close()
            pub.shutdown()

    asyncio.run(main())


def test_answers_whose_events_already_arrived_cost_no_round_trip(tmp_path: Path) -> None:
    async def main() -> None:
        kv, core, pub, hashes = _manager(tmp_path)
        try:
            await _connected(kv, core, hashes)
            kv.answered(R, hashes[:1])
            kv.answered(R, [])  # a prompt shorter than a block stores nothing
            await kv.sync()
            assert core.calls == [] and kv.state(R).late_event_waits == 0
        finally:
            await kv.close()
            pub.shutdown()

    asyncio.run(main())


def test_in_order_publish_returns_once_the_batch_is_sent(tmp_path: Path) -> None:
    pub = kv_events.ZmqEventPublisher(
        data_parallel_rank=0, endpoint=f"ipc://{tmp_path}/io", replay_endpoint=None
    )
    try:
        publish = in_order(type(pub).publish, timeout_s=10.0)
        for i in range(20):
            publish(pub, _stored([]))
            assert pub._event_queue.unfinished_tasks == 0  # handed to ZMQ already
            assert pub._buffer[-1][0] == i
    finally:
        pub.shutdown()
