"""The fair gate in front of a replica: slots, virtual token counters per tenant, the
lift of a returning tenant, priorities first, cancellation while waiting, the
first-token guard."""

from __future__ import annotations

import asyncio

from gateway.local.fairness import FairGate


def test_a_flooding_tenant_does_not_take_every_slot() -> None:
    async def main() -> list[str]:
        gate = FairGate(slots=1)
        order: list[str] = []

        async def one(tenant: str) -> None:
            entry = await gate.enter(tenant, 0, 100)
            order.append(tenant)
            await asyncio.sleep(0)
            gate.leave(entry, 10)

        first = await gate.enter("flood", 0, 100)  # holds the slot while the others queue
        tasks = [asyncio.create_task(one("flood")) for _ in range(6)]
        await asyncio.sleep(0)
        tasks += [asyncio.create_task(one("agent")) for _ in range(2)]
        await asyncio.sleep(0)
        assert len(gate) == 8 and gate.running == 1
        gate.leave(first, 10)
        await asyncio.gather(*tasks)
        return order

    order = asyncio.run(main())
    # the agent, lifted to the flood's counter, is served within the first few, not last
    assert order.index("agent") <= 2
    assert order.count("agent") == 2 and order[-1] == "flood"


def test_interactive_goes_before_default_and_batch() -> None:
    async def main() -> list[str]:
        gate = FairGate(slots=1)
        order: list[str] = []

        async def one(name: str, prio: int) -> None:
            entry = await gate.enter(name, prio, 1)
            order.append(name)
            gate.leave(entry, 1)

        x = await gate.enter("x", 0, 1)
        tasks = [asyncio.create_task(one(n, p)) for n, p in (("b", 1), ("d", 0), ("i", -1))]
        await asyncio.sleep(0)
        gate.leave(x, 1)
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(main()) == ["i", "d", "b"]


def test_a_cancelled_waiter_leaves_the_queue_and_slots_are_not_lost() -> None:
    async def main() -> None:
        gate = FairGate(slots=1)
        a = await gate.enter("a", 0, 1)
        waiting = asyncio.create_task(gate.enter("b", 0, 1))
        await asyncio.sleep(0)
        assert len(gate) == 1
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        assert len(gate) == 0
        gate.leave(a, 1)
        assert gate.running == 0
        await asyncio.wait_for(gate.enter("c", 0, 1), 1)  # the slot is free again
        assert gate.running == 1 and gate.counters["c"] == 1

    asyncio.run(main())


def test_counters_charge_uncached_prompt_then_output() -> None:
    async def main() -> None:
        gate = FairGate(slots=4)
        t = await gate.enter("t", 0, 300)
        assert gate.counters["t"] == 300
        gate.leave(t, 20)
        assert gate.counters["t"] == 320 and gate.running == 0

    asyncio.run(main())


def test_no_lower_class_starts_while_a_higher_one_waits_for_its_first_token() -> None:
    async def main() -> None:
        gate = FairGate(slots=None)  # no slot limit: the guard alone
        interactive = await gate.enter("agent", -1, 500)
        batch = asyncio.create_task(gate.enter("bulk", 1, 400))
        default = asyncio.create_task(gate.enter("other", 0, 100))
        same = await asyncio.wait_for(gate.enter("agent2", -1, 50), 1)  # its own class starts
        await asyncio.sleep(0)
        assert not batch.done() and not default.done() and gate.held == 2
        gate.first_token(same)
        await asyncio.sleep(0)
        assert not batch.done() and not default.done()  # one interactive still prefills
        gate.first_token(interactive)
        default_entry = await asyncio.wait_for(default, 1)  # the higher of the two first
        await asyncio.sleep(0)
        assert not batch.done()  # the default request now prefills
        gate.leave(default_entry, 3)  # ended (or failed) before a token: no longer held
        bulk = await asyncio.wait_for(batch, 1)
        assert gate.running == 3  # the two interactive and the batch one
        for e in (interactive, same, bulk):
            gate.leave(e, 1)
        assert gate.running == 0 and gate.free(1)

    asyncio.run(main())


def test_the_guard_off_lets_every_class_start_at_once() -> None:
    async def main() -> None:
        gate = FairGate(slots=None, guard=False)
        await gate.enter("agent", -1, 500)
        await asyncio.wait_for(gate.enter("bulk", 1, 400), 1)
        assert gate.running == 2 and gate.held == 0

    asyncio.run(main())


def test_a_held_waiter_cancelled_releases_nothing_it_did_not_take() -> None:
    async def main() -> None:
        gate = FairGate(slots=2)
        interactive = await gate.enter("agent", -1, 1)
        batch = asyncio.create_task(gate.enter("bulk", 1, 1))
        await asyncio.sleep(0)
        batch.cancel()
        await asyncio.gather(batch, return_exceptions=True)
        assert len(gate) == 0 and gate.running == 1
        gate.first_token(interactive)
        gate.leave(interactive, 1)
        assert gate.running == 0 and gate.free(1)

    asyncio.run(main())


def test_prefill_slots_cap_how_many_of_a_class_prefill_at_once() -> None:
    async def main() -> None:
        gate = FairGate(slots=None, prefill_slots={0: 1})
        first = await gate.enter("bg", 0, 400)
        second = asyncio.create_task(gate.enter("bg", 0, 400))
        await asyncio.sleep(0)
        assert not second.done() and gate.held == 1  # one default prompt at a time
        agent = await asyncio.wait_for(gate.enter("agent", -1, 200), 1)  # no cap on its class
        gate.first_token(first)
        await asyncio.sleep(0)
        assert not second.done()  # the interactive prompt still prefills: the guard holds it
        gate.first_token(agent)
        nxt = await asyncio.wait_for(second, 1)
        assert gate.running == 3
        for e in (first, agent, nxt):
            gate.leave(e, 1)
        assert gate.running == 0

    asyncio.run(main())


def test_a_held_class_does_not_hold_an_unheld_one_behind_it() -> None:
    async def main() -> None:
        gate = FairGate(slots=None, guard=False, prefill_slots={0: 1})
        await gate.enter("bg", 0, 400)
        waiting = asyncio.create_task(gate.enter("bg", 0, 400))
        await asyncio.sleep(0)
        # a batch request with no cap of its own and no guard starts past the held one
        await asyncio.wait_for(gate.enter("bulk", 1, 10), 1)
        assert not waiting.done() and gate.running == 2
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)

    asyncio.run(main())
