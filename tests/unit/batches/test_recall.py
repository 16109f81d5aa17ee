"""Recall (M4): the cost gate with the design note's numbers (a 30k-token prefix for
one 10-token unit refused; 334 siblings recalled together accepted, 333 not), and the
runner's recall path: a resumed batch whose parent item is done replays its chain
(root first, one output token) before the items extending it, when the gate passes;
prefills fresh when it does not; every decision counted with its predicted cost."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from gateway.batches.recall import chain, decide, default_gate, warm_body
from gateway.batches.runner import BatchRunner
from gateway.batches.send import Outcome
from gateway.batches.store import BatchStore, BatchUsage, NewItem
from gateway.core.metrics import Metrics
from gateway.core.types import Principal
from manifest.prefix_dag import PrefixDag, Unit
from tests.unit.batches.test_runner import _ended, store  # noqa: F401
from tests.unit.waits import until

CHAT = "/v1/chat/completions"


def _family(k: int, prefix: int = 30_000, unit: int = 10) -> list[Unit]:
    parent = Unit("p", ("h",), (prefix,))
    return [parent, *(Unit(f"c{i}", ("h", f"t{i}"), (prefix, unit)) for i in range(k))]


def test_one_short_unit_under_a_30k_prefix_is_refused() -> None:
    us = _family(1)
    dag = PrefixDag(us)
    [d] = decide(us, dag.parents(), {"c0"}, default_gate())
    assert (d.parent, d.siblings, d.prefix_tokens, d.unit_tokens) == ("p", 1, 30_000, 10)
    assert not d.replay
    assert (d.replay_cost, d.saving) == (3000.0, 9.0)  # the 300x loss
    assert d.as_dict()["decision"] == "fresh"


def test_siblings_recalled_together_pay_above_break_even() -> None:
    for k, pays in ((333, False), (334, True)):  # k*10*0.9 > 30000*0.1 from k = 334
        us = _family(k)
        [d] = decide(us, PrefixDag(us).parents(), {u.id for u in us[1:]}, default_gate())
        assert (d.siblings, d.replay) == (k, pays)


def test_only_a_settled_parent_with_open_children_is_decided() -> None:
    us = _family(3)
    parents = PrefixDag(us).parents()
    assert decide(us, parents, {"p", "c0", "c1", "c2"}, default_gate()) == []  # runs in order
    assert decide(us, parents, set(), default_gate()) == []  # nothing left to read it
    grand = [*us, Unit("g", ("h", "t0", "x"), (30_000, 10, 5))]
    assert chain(PrefixDag(grand).parents(), "g") == ("p", "c0", "g")


def test_a_replay_asks_for_one_token() -> None:
    body = {"model": "m", "messages": [], "max_completion_tokens": 500, "n": 2}
    assert warm_body(CHAT, body) == {"model": "m", "messages": [], "max_tokens": 1}
    assert warm_body("/v1/responses", {"model": "m", "input": "x"})["max_output_tokens"] == 16


def chat(*turns: str) -> dict[str, Any]:
    messages = [{"role": "system", "content": "You continue the story."}]
    for i, t in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    return {"model": "m", "max_tokens": 50, "messages": messages}


class Recorder:
    def __init__(self) -> None:
        self.sent: list[tuple[str, Any]] = []  # (last turn, max_tokens)

    async def __call__(
        self,
        endpoint: str,
        body: dict[str, Any],
        who: Principal,
        started: asyncio.Event | None = None,
    ) -> Outcome:
        self.sent.append((body["messages"][-1]["content"], body.get("max_tokens")))
        return Outcome(200, "r", body={}, usage=BatchUsage(10, 0, 1))


def _resumed(store: BatchStore) -> str:  # noqa: F811
    """A batch whose parent item (0) was answered before a restart; 1 and 2 extend it."""
    bodies = [chat("q"), chat("q", "a", "more"), chat("q", "a", "other")]
    items = [NewItem(f"i{n}", json.dumps(b)) for n, b in enumerate(bodies)]
    bid = store.create("openai", "one", "key", CHAT, "m", items, window_s=3600).id
    assert store.claim(bid, 0, "old-gateway", 60)
    assert store.finish(bid, 0, "old-gateway", True, 200, {"request_id": "r0"}, BatchUsage())
    return bid


def _run(store: BatchStore, runner: BatchRunner, bid: str) -> None:  # noqa: F811
    async def main() -> None:
        task = asyncio.create_task(runner.run())
        await until(lambda: _ended(store, bid), "the batch ended")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())


def test_with_the_gate_forced_on_the_chain_is_replayed_first(
    store: BatchStore,  # noqa: F811
) -> None:
    bid = _resumed(store)
    sender = Recorder()
    metrics = Metrics()
    runner = BatchRunner(store, sender, poll_s=0.01, recall=lambda p, u, k: True, metrics=metrics)
    _run(store, runner, bid)
    assert sender.sent[0] == ("q", 1)  # the parent's prompt, one token, before its children
    assert sorted(sender.sent[1:]) == [("more", 50), ("other", 50)]
    assert runner.recall_counted == {"replay": 1}
    sample = metrics.registry.get_sample_value
    assert sample("vcache_batch_recall_total", {"decision": "replay"}) == 1.0
    [d] = runner.recall_decisions
    saving = {"decision": "replay", "kind": "saving"}
    assert sample("vcache_batch_recall_tokens_total", saving) == d["saving"]
    assert (d["batch"], d["parent"], d["siblings"], d["decision"]) == (bid, "0", 2, "replay")
    row = store.batch(bid)
    assert row is not None and row.counts.done == 3  # the replay is no item's answer
    # measured once the items ran: the replay's 10 uncached input tokens, the children
    # read nothing (the recorder's usage)
    assert d["children"] == ["1", "2"]
    assert d["measured"] == {"replay_cost": 10.0, "saving": 0.0}
    measured = {"decision": "replay", "kind": "replay_cost_measured"}
    assert sample("vcache_batch_recall_tokens_total", measured) == 10.0


def test_with_the_gate_refusing_the_children_prefill_fresh(
    store: BatchStore,  # noqa: F811
) -> None:
    bid = _resumed(store)
    sender = Recorder()
    runner = BatchRunner(store, sender, poll_s=0.01, recall=lambda p, u, k: False)
    _run(store, runner, bid)
    assert sorted(sender.sent) == [("more", 50), ("other", 50)]
    assert runner.recall_counted == {"fresh": 1}
    assert runner.recall_decisions[0]["decision"] == "fresh"


def test_recall_off_decides_nothing(store: BatchStore) -> None:  # noqa: F811
    bid = _resumed(store)
    sender = Recorder()
    runner = BatchRunner(store, sender, poll_s=0.01)
    _run(store, runner, bid)
    assert len(sender.sent) == 2 and runner.recall_counted == {}
