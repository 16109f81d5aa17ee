"""Anchors pinned while their siblings run: taken when the lead lets them go, held
while any of them runs, released once the last has ended (and when the walk is
cancelled), counted; and which messages a chat anchor's pin names."""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.batches.pins import Receipt, prefix_messages
from gateway.batches.runner import BatchRunner
from gateway.batches.store import BatchStore
from gateway.core.types import Principal
from gateway.service.cache import CacheRequest
from tests.unit.batches.test_runner import Sender, _create, _ended, store  # noqa: F401
from tests.unit.waits import until


class Pins:
    """Records pins and releases by owner."""

    def __init__(self) -> None:
        self.held: dict[str, int] = {}
        self.log: list[tuple[str, str, int]] = []

    async def pin(
        self, endpoint: str, body: dict[str, Any], segments: int, owner: Principal, lease_s: float
    ) -> Receipt | None:
        name = owner.key_name or ""
        self.held[name] = segments
        self.log.append(("pin", name, segments))
        req = CacheRequest.model_validate({"model": "m", "prompt": "x"})
        return Receipt(req, owner, segments)

    async def release(self, receipt: Receipt) -> None:
        name = receipt.owner.key_name or ""
        del self.held[name]
        self.log.append(("release", name, receipt.blocks))


def test_an_anchor_is_pinned_while_its_siblings_run_and_released_after(
    store: BatchStore,  # noqa: F811
) -> None:
    bid = _create(store, [("A", "a1"), ("A", "a2"), ("A", "a3"), ("B", "b1")])
    sender = Sender(gated=("a1", "a2", "a3"))
    pins = Pins()

    async def main() -> None:
        runner = BatchRunner(store, sender, concurrency=8, poll_s=0.01, pins=pins)
        task = asyncio.create_task(runner.run())
        await until(lambda: sender.sent == ["a1"], "the lead sent")
        assert pins.held == {}  # nothing pinned while the lead computes the prefix
        sender.gates["a1"].set()
        await until(lambda: {"a2", "a3"} <= set(sender.sent), "the siblings sent")
        assert pins.held == {f"batch:{bid}:0": 1}  # the header segment the siblings share
        sender.gates["a2"].set()
        await until(lambda: "a2" in sender.ended, "a2 ended")
        for _ in range(20):
            await asyncio.sleep(0)
        assert pins.held == {f"batch:{bid}:0": 1}  # a3 still runs: still pinned
        sender.gates["a3"].set()
        await until(lambda: _ended(store, bid), "the batch ended")
        assert pins.held == {}
        assert runner.pins_counted == {"taken": 1, "released": 1}
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    assert pins.log == [("pin", f"batch:{bid}:0", 1), ("release", f"batch:{bid}:0", 1)]


def test_a_cancelled_walk_releases_its_pins(store: BatchStore) -> None:  # noqa: F811
    bid = _create(store, [("A", "a1"), ("A", "a2"), ("A", "a3")])
    sender = Sender(gated=("a2", "a3"))
    pins = Pins()

    async def main() -> None:
        runner = BatchRunner(store, sender, concurrency=8, poll_s=0.01, pins=pins)
        task = asyncio.create_task(runner.run())
        await until(lambda: {"a2", "a3"} <= set(sender.sent), "the siblings sent")
        assert pins.held == {f"batch:{bid}:0": 1}
        task.cancel()  # the gateway stops mid-batch
        await asyncio.gather(task, return_exceptions=True)
        assert pins.held == {}
        assert runner.pins_counted == {"taken": 1, "released": 1}

    asyncio.run(main())


def test_a_chat_anchors_pin_names_its_system_messages_and_first_turns() -> None:
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "u1"},
            {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "u2"},
        ],
    }
    assert prefix_messages(body, 1) == [{"role": "system", "content": "S"}]
    assert prefix_messages(body, 3) == body["messages"][:3]
    assert prefix_messages({"messages": [{"role": "user", "content": "x"}]}, 1) is None
    assert prefix_messages(body, 0) is None
