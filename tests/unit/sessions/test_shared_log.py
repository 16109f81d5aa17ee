"""One session log shared by several gateways: each appends after the others and folds
what they wrote (SQLite file across processes, PostgreSQL across hosts)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest

from engines.providers.specs import adapter_for
from gateway.core.errors import Unavailable
from gateway.service.health import StoreProbe
from gateway.sessions.log import SessionLog
from gateway.sessions.reconstruct import Reconstructor
from gateway.sessions.store import SessionStore
from manifest.sessionlog import (
    DispatchEvent,
    Event,
    Header,
    HeaderEvent,
    MessageEvent,
    ResponseEvent,
    fold,
    scoped_session,
)

MakeStore = Callable[..., SessionStore]
HEADER = Header.make("m", "local", ["you are terse"])


def _log(store: SessionStore) -> SessionLog:
    return SessionLog(store, Reconstructor(adapter_for, lambda: None), verify=False)


async def _turn(log: SessionLog, turns: list[MessageEvent], rid: str, answer: str) -> str:
    op = log.open("t", HEADER, tuple(turns), "conv")
    await log.dispatch(op, rid, "local", "vllm", {}, rid.encode())
    await log.respond(op, rid, answer, {"prompt_tokens": 1})
    assert op.session_id is not None
    return op.session_id


def test_each_request_keeps_how_it_found_its_session(make_store: MakeStore) -> None:
    """The log names the session kind of every request: named (by the client), new, or
    found again by its prefix digests (a stateless client's next turn)."""
    log = _log(make_store())
    try:
        u1, a1, u2 = (
            MessageEvent("user", "q1"),
            MessageEvent("assistant", "r1"),
            MessageEvent("user", "q2"),
        )

        async def turn(turns: list[MessageEvent], rid: str, session: str | None) -> str:
            op = log.open("t", HEADER, tuple(turns), session)
            await log.dispatch(op, rid, "local", "vllm", {}, rid.encode())
            await log.respond(op, rid, "r1", {"prompt_tokens": 1})
            assert op.session_id is not None
            return op.session_id

        async def main() -> tuple[str, str]:
            implicit = await turn([u1], "req-1", None)
            assert await turn([u1, a1, u2], "req-2", None) == implicit
            return implicit, await turn([u1], "req-3", "mine")

        implicit, named = asyncio.run(main())
        kinds = {
            e.request_id: e.session_kind
            for sid in (implicit, named)
            for _, e in log.store.events(sid)
            if isinstance(e, DispatchEvent)
        }
        assert kinds == {"req-1": "new", "req-2": "found", "req-3": "named"}
    finally:
        log.close()


def test_two_gateways_continue_one_conversation(make_store: MakeStore) -> None:
    a, b = _log(make_store()), _log(make_store())
    u1, a1 = MessageEvent("user", "q1"), MessageEvent("assistant", "r1")
    u2, a2 = MessageEvent("user", "q2"), MessageEvent("assistant", "r2")
    u3 = MessageEvent("user", "q3")

    async def main() -> str:
        sid = await _turn(a, [u1], "req-1", "r1")  # gateway A: the first turn
        assert await _turn(b, [u1, a1, u2], "req-2", "r2") == sid  # B: only q2 is new
        # A's cached fold is two events behind the store: it folds B's in, appends q3 only
        assert await _turn(a, [u1, a1, u2, a2, u3], "req-3", "r3") == sid
        return sid

    sid = asyncio.run(main())
    events = [e for _, e in a.store.events(sid)]
    assert [e.request_id for e in events if isinstance(e, DispatchEvent)] == [
        "req-1",
        "req-2",
        "req-3",
    ]
    said = [e for e in events if isinstance(e, MessageEvent)]
    assert said == [u1, a1, u2, a2, u3, MessageEvent("assistant", "r3")]  # no turn twice
    # B had never seen the session: it recorded a resume snapshot, as after a restart
    assert sum(isinstance(e, HeaderEvent) for e in events) == 2
    assert fold(events).messages == tuple(said)
    assert [seq for seq, _ in a.store.events(sid)] == list(range(len(events)))
    assert sid == scoped_session("t", "conv")
    a.close()
    b.close()


def test_concurrent_appends_of_two_gateways_to_one_session_interleave_whole(
    make_store: MakeStore,
) -> None:
    """Two writers (two gateways' own connections) append to one session at once: each
    request's events stay together, numbered after the other's, none lost."""
    stores = [make_store(), make_store()]
    sid = stores[0].create("t", "t/shared")
    per_writer, failures = 40, []

    def write(w: int) -> None:
        store = stores[w]
        try:
            for i in range(per_writer):
                rid = f"w{w}-{i}"
                with store.batch() as item, item():
                    store.lock_session(sid)
                    events: list[Event] = [
                        MessageEvent("user", rid),
                        DispatchEvent(rid, "local", "vllm", (), "0" * 64),
                    ]
                    store.append(sid, events, (rid, "local", "0" * 64))
        except Exception as exc:  # reported below: a thread's failure fails the test
            failures.append(exc)

    threads = [threading.Thread(target=write, args=(w,)) for w in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert failures == []
    events = stores[1].events(sid)
    assert [seq for seq, _ in events] == list(range(4 * per_writer))
    pairs = [(events[i][1], events[i + 1][1]) for i in range(0, len(events), 2)]
    assert all(
        isinstance(m, MessageEvent) and isinstance(d, DispatchEvent) and m.content == d.request_id
        for m, d in pairs
    )
    assert len(stores[0].requests(sid)) == 2 * per_writer


def test_an_answer_folds_after_another_gateways_turn(make_store: MakeStore) -> None:
    """B answers after A appended to the session: B's answer follows its own question."""
    a, b = _log(make_store()), _log(make_store())
    u1 = MessageEvent("user", "q1")

    async def main() -> str:
        op_b = b.open("t", HEADER, (u1,), "conv")
        await b.dispatch(op_b, "req-b", "local", "vllm", {}, b"b")
        sid = await _turn(
            a, [u1, MessageEvent("assistant", "ra"), MessageEvent("user", "qa")], "req-a", "ra2"
        )
        await b.respond(op_b, "req-b", "rb", {"prompt_tokens": 1})
        return sid

    sid = asyncio.run(main())
    events = [e for _, e in a.store.events(sid)]
    last = fold(events)
    assert last.messages[-1] == MessageEvent("assistant", "rb")
    assert last.messages[0] == u1 and len(last.messages) == 2  # brought back to B's question
    assert isinstance(events[-1], ResponseEvent) and events[-1].request_id == "req-b"
    a.close()
    b.close()


def test_a_store_that_fails_is_a_503_and_marks_the_log_failing(make_store: MakeStore) -> None:
    """The store gone (its server restarting): the request is not sent, the caller gets a
    503 with Retry-After, readiness sees the failure; the next commit clears it."""
    store = make_store()
    log = _log(store)
    u1 = MessageEvent("user", "q1")
    real = store.append
    down = True

    def append(*args: object, **kwargs: object) -> list[int]:
        if down:
            raise ConnectionError("server closed the connection unexpectedly")
        return real(*args, **kwargs)  # type: ignore[arg-type]

    store.append = append  # type: ignore[method-assign]
    probe = StoreProbe("session_log", lambda: log.writer.failing_since, grace_s=5)

    async def main() -> None:
        nonlocal down
        op = log.open("t", HEADER, (u1,), "conv")
        with pytest.raises(Unavailable) as err:
            await log.dispatch(op, "req-1", "local", "vllm", {}, b"x")
        assert err.value.code == "session_log_unavailable"
        assert err.value.headers()["Retry-After"] == "2"
        assert op.dispatch_seq is None  # nothing acknowledged
        since = log.writer.failing_since
        assert since is not None
        assert probe.state(since + 1) == "degraded" and probe.state(since + 6) == "unavailable"
        down = False
        await log.dispatch(op, "req-1", "local", "vllm", {}, b"x")
        assert log.writer.failing_since is None and probe.state(since + 6) == "ok"

    asyncio.run(main())
    assert [r.request_id for r in store.requests()] == ["req-1"]
    log.close()
