"""What the session log remembers to spare the hot path work: the rolling digests of the
conversation entries it saw (on the loop), and each session's folded state (on the
writer thread).  Neither may ever differ from what it spares."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.providers.specs import adapter_for
from gateway.sessions.log import Links, SessionLog
from gateway.sessions.reconstruct import Reconstructor
from gateway.sessions.store import SessionStore
from manifest.canonical import canonical_json
from manifest.sessionlog import Header, MessageEvent, chain, fold

MakeStore = Callable[..., SessionStore]
HEADER = Header.make("m", "local", ["you are terse", "and exact"])


def _manifest_chain(root: bytes, header: Header, messages: tuple[MessageEvent, ...]) -> list[str]:
    """The digests as the log always wrote them: manifest's chain over each entry's bytes."""
    entries = [canonical_json(["system", s]) for s in header.system]
    return chain(root, entries + [canonical_json(list(m.key())) for m in messages])


_MESSAGES = st.lists(
    st.builds(
        MessageEvent,
        st.sampled_from(["user", "assistant", "tool"]),
        st.text(max_size=40),
        st.none() | st.text(max_size=5),
        tool_calls=st.none() | st.text(max_size=10),
    ),
    max_size=6,
)


@settings(max_examples=100, deadline=None)
@given(
    convos=st.lists(
        st.tuples(st.lists(st.text(max_size=30), max_size=2), _MESSAGES), min_size=1, max_size=8
    ),
    budget=st.sampled_from([1, 64, 1 << 20]),
)
def test_remembered_links_are_the_manifest_chain(
    convos: list[tuple[list[str], list[MessageEvent]]], budget: int
) -> None:
    """Whatever was remembered or evicted before (a budget of 1 character keeps one entry),
    a conversation's digests are manifest's chain of its entries, the implicit sessions'
    heads of every log written before."""
    links = Links(chars=budget)
    for _ in range(2):  # the second pass hits what the first remembered
        for system, messages in convos:
            header = Header.make("m", "local", system)
            turns = tuple(messages)
            for root in (b"t\0m", b"u\0m"):
                keys = [("system", s) for s in header.system] + [m.key() for m in turns]
                assert links.chain(root, keys) == _manifest_chain(root, header, turns)


def test_links_hold_at_most_their_budget() -> None:
    links = Links(chars=1000)
    digest = chain(b"t\0m", [])[0]
    for i in range(50):
        links(digest, ("user", f"{i:08d}"))  # 12 characters each, and 128 of its own
    assert links._held <= 1000 and len(links._seen) == 1000 // 140


def test_an_open_requests_digests_are_the_manifest_chain(make_store: MakeStore) -> None:
    log = SessionLog(make_store(), Reconstructor(adapter_for, lambda: None), verify=False)
    turns = (MessageEvent("user", "q1"), MessageEvent("assistant", "a1", tool_calls="[]"))
    for _ in range(2):
        op = log.open("t", HEADER, turns)
        assert op.digests == _manifest_chain(b"t\0m", HEADER, turns)
        assert op.length == 4
    log.close()


def test_the_remembered_state_is_the_store_folded_after_every_append(
    make_store: MakeStore,
) -> None:
    """Answers appended right after their own dispatch (the state extended, not folded
    again), and one whose session moved on meanwhile (a concurrent fork of the same
    conversation): after each append the state the log keeps is the store's, folded."""
    store = make_store()
    log = SessionLog(store, Reconstructor(adapter_for, lambda: None), verify=False)
    q1, a1 = MessageEvent("user", "q1"), MessageEvent("assistant", "a1")

    def check(sid: str) -> None:
        """What the next request's events are worked out from: the header and messages."""
        seq, state = log._states[sid]
        folded = fold(e for _, e in store.events(sid))
        assert seq == store.last_seq(sid)
        assert (state.header, state.messages) == (folded.header, folded.messages)

    async def main() -> None:
        first = log.open("t", HEADER, (q1,), "conv")
        await log.dispatch(first, "r1", "local", "vllm", {}, b"1")
        assert first.session_id is not None
        sid = first.session_id
        check(sid)
        await log.respond(first, "r1", "a1", {"prompt_tokens": 1})
        check(sid)
        # two requests of the conversation at once: the first answer lands after the
        # second's dispatch, so it brings the session back to its own question first
        one = log.open("t", HEADER, (q1, a1, MessageEvent("user", "q2")), "conv")
        two = log.open("t", HEADER, (q1, a1, MessageEvent("user", "q2'")), "conv")
        await log.dispatch(one, "r2", "local", "vllm", {}, b"2")
        await log.dispatch(two, "r3", "local", "vllm", {}, b"3")
        await log.respond(one, "r2", "a2", {"prompt_tokens": 2})
        check(sid)
        assert fold(e for _, e in store.events(sid, one.answer_seq)).messages[-2:] == (
            MessageEvent("user", "q2"),
            MessageEvent("assistant", "a2"),
        )
        await log.respond(two, "r3", "a3", {"prompt_tokens": 3})
        check(sid)
        # an implicit session, continued by its next request
        new = log.open("t", HEADER, (MessageEvent("user", "hello"),))
        await log.dispatch(new, "r4", "local", "vllm", {}, b"4")
        await log.respond(new, "r4", "hi", {"prompt_tokens": 4})
        assert new.session_id is not None and new.kind == "new"
        check(new.session_id)
        turns = (MessageEvent("user", "hello"), MessageEvent("assistant", "hi"))
        on = log.open("t", HEADER, (*turns, MessageEvent("user", "more")))
        await log.dispatch(on, "r5", "local", "vllm", {}, b"5")
        assert on.session_id == new.session_id and on.kind == "found"
        await log.respond(on, "r5", "done", {"prompt_tokens": 5})
        check(new.session_id)

    asyncio.run(main())
    log.close()


def test_an_append_told_the_last_event_must_be_inside_a_batch(make_store: MakeStore) -> None:
    store = make_store()
    with pytest.raises(ValueError, match="outside a batch"):
        store.append("s", [MessageEvent("user", "x")], last=0)


def test_a_sessions_time_moves_with_its_requests_not_with_their_answers(
    make_store: MakeStore,
) -> None:
    """``updated`` (what retention ages and the listing orders by) is when the session's
    last request was recorded: an answer's append spares the statement."""
    ticks = iter(range(100, 200))
    store = make_store(clock=lambda: float(next(ticks)))
    log = SessionLog(store, Reconstructor(adapter_for, lambda: None), verify=False)
    q1 = MessageEvent("user", "q1")

    async def turn(rid: str, turns: tuple[MessageEvent, ...]) -> tuple[float, float]:
        """When the request's dispatch and its answer were appended."""
        op = log.open("t", HEADER, turns, "conv")
        await log.dispatch(op, rid, "local", "vllm", {}, rid.encode())
        await log.respond(op, rid, "a", {"prompt_tokens": 1})
        times = dict(
            store._sql.execute(
                "SELECT seq, created FROM events WHERE session_id = ?", (op.session_id,)
            ).fetchall()
        )
        return times[op.dispatch_seq], times[op.answer_seq]

    def updated() -> float:
        return next(s.updated for s in store.sessions())

    asyncio.run(turn("r1", (q1,)))
    sent, answered = asyncio.run(turn("r2", (q1, MessageEvent("assistant", "a"), q1)))
    assert updated() == sent < answered
    log.close()
