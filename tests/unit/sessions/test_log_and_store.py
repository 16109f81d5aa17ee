"""The session log's pure event model and its store (SQLite here; PostgreSQL in the
stores tier, a writer killed mid-append in the processes tier)."""

from __future__ import annotations

import itertools
import sqlite3
from collections.abc import Callable
from pathlib import Path

import psycopg.errors
import pytest

from gateway.sessions.store import SessionStore
from manifest.sessionlog import (
    DispatchEvent,
    Event,
    Header,
    HeaderEvent,
    MessageEvent,
    Reason,
    ReplaceEvent,
    ResponseEvent,
    State,
    TruncateEvent,
    canonical_config,
    chain,
    changes,
    decode,
    encode,
    fold,
    link,
)

MakeStore = Callable[..., SessionStore]
LONG = "a system prompt long enough to be stored as a blob, shared by sessions. " * 5


def test_empty_values_are_absent_in_header_snapshots() -> None:
    a = Header.make("m", "local", ["s"], [], {"stop": [], "seed": None, "temperature": 0.5})
    b = Header.make("m", "local", ["s"], None, {"temperature": 0.5, "user": ""})
    assert a == b and a.tools is None and a.config == (("temperature", 0.5),)
    assert canonical_config({"stop": ["x"], "b": 1}) == (("b", 1), ("stop", ("x",)))
    tools = Header.make("m", "t", (), [{"type": "function", "function": {"name": "f"}}])
    assert tools.tool_list() == [{"function": {"name": "f"}, "type": "function"}]


def test_changes_append_snapshot_replace_and_truncate() -> None:
    h1 = Header.make("m", "local", ["s"])
    u1, a1, u2 = (
        MessageEvent("user", "q1"),
        MessageEvent("assistant", "a1"),
        MessageEvent("user", "q2"),
    )
    first = changes(State(), h1, [u1])
    assert first == [HeaderEvent(h1, Reason.INITIAL), u1]
    state = fold([*first, a1])
    assert changes(state, h1, [u1, a1, u2]) == [u2]  # an extension appends only
    h2 = Header.make("m", "local", ["s2"])
    trimmed = MessageEvent("user", "q1 (trimmed)")
    out = changes(state, h2, [trimmed])
    assert out == [HeaderEvent(h2, Reason.CHANGE), ReplaceEvent(0, trimmed), TruncateEvent(1)]
    after = fold([*first, a1, *out])
    assert after.header == h2 and after.messages == (trimmed,)


def test_fold_refuses_impossible_edits_and_tracks_the_last_dispatch() -> None:
    with pytest.raises(ValueError, match="replace"):
        fold([ReplaceEvent(0, MessageEvent("user", "x"))])
    with pytest.raises(ValueError, match="truncate"):
        fold([TruncateEvent(2)])
    d = DispatchEvent("r1", "local", "vllm", (("cache_salt", "t"),), "00")
    assert fold([d]).last_dispatch == d and d.settings() == {"cache_salt": "t"}


@pytest.mark.parametrize(
    "event",
    [
        HeaderEvent(
            Header.make("m", "anthropic/c", [LONG, "short"], [{"n": 1}], {"stop": ["x"]}),
            Reason.RESUME,
        ),
        MessageEvent("user", LONG, "alice"),
        MessageEvent("assistant", "short"),
        ReplaceEvent(3, MessageEvent("tool", LONG)),
        TruncateEvent(2),
        DispatchEvent(
            "r", "openai/gpt-5", "provider", (("breakpoints", ("system",)), ("ttl_s", 300)), "ab"
        ),
        DispatchEvent("r", "local", "vllm", (), "cd", session_kind="found"),
        ResponseEvent("r", (("cached_tokens", 5), ("prompt_tokens", 9)), "resp_1"),
    ],
)
def test_encode_decode_round_trip_with_blobs(event: Event) -> None:
    enc = encode(event)
    assert LONG.encode() not in enc.data  # long strings live in blobs
    back = decode(enc.data, lambda d: enc.blobs[d])
    assert back == event


def test_decode_rejects_unknown_kinds() -> None:
    with pytest.raises(ValueError, match="unknown"):
        decode(b'{"kind":"nope"}', lambda d: b"")


def test_chain_digests_extend() -> None:
    a = chain(b"root", [b"x", b"y"])
    b = chain(b"root", [b"x", b"y", b"z"])
    assert len(a) == 3 and b[:3] == a and chain(b"other", [b"x"])[1] != a[1]
    assert link(a[-1], b"z") == b[-1]  # one step on from a known digest


def test_find_head_is_the_latest_digest_listed_past_one_query(make_store: MakeStore) -> None:
    """Heads found in one query per 500 digests; the one listed last wins, whatever its
    stored length, in whichever chunk it falls."""
    store = make_store()
    digests = [f"d{i}" for i in range(1200)]
    early = store.append("t/early", [MessageEvent("user", "a")], None, [("t", "d3", 9)], "t")
    assert early == [0]
    store.append("t/late", [MessageEvent("user", "b")], None, [("t", "d700", 2)], "t")
    store.append("t/other", [MessageEvent("user", "c")], None, [("u", "d1100", 5)], "u")
    assert store.find_head("t", digests) == ("t/late", 2)
    assert store.find_head("t", digests[:600]) == ("t/early", 9)
    assert store.find_head("u", digests) == ("t/other", 5)
    assert store.find_head("t", ["nope"]) is None


def test_a_new_session_is_created_by_its_first_append(make_store: MakeStore) -> None:
    store = make_store()
    assert store.append("t/new", [MessageEvent("user", "a"), _dispatch(0)], None, (), "t") == [0, 1]
    assert store.tenant("t/new") == "t"
    assert store.append("t/new", [MessageEvent("assistant", "b")]) == [2]
    assert [e for _, e in store.events("t/new")][2] == MessageEvent("assistant", "b")
    with pytest.raises((sqlite3.IntegrityError, psycopg.errors.UniqueViolation)):  # one id, one
        store.append("t/new", [MessageEvent("user", "c")], None, (), "t")
    assert [seq for seq, _ in store.events("t/new")] == [0, 1, 2]  # the failed one left none


def _dispatch(i: int) -> DispatchEvent:
    return DispatchEvent(f"req-{i}", "local", "vllm", (), f"{i:064x}")


def test_store_shares_blobs_and_retention_drops_whole_sessions(make_store: MakeStore) -> None:
    ticks = itertools.count(1_700_000_000.0)  # a wall clock one second on at every reading
    store = make_store("full", clock=lambda: next(ticks))
    h = Header.make("m", "local", [LONG])
    ids = []
    for i in range(3):
        sid = store.create("t")
        store.append(
            sid,
            [HeaderEvent(h, Reason.INITIAL), MessageEvent("user", f"q{i}"), _dispatch(i)],
            (f"req-{i}", "local", f"{i:064x}"),
            [("t", f"head-{i}", 2)],
        )
        ids.append(sid)
    blobs = store._sql.execute("SELECT COUNT(*) FROM blobs").fetchone()[0]
    assert blobs == 1  # the shared system prompt is stored once
    assert store.find_head("t", ["nope", "head-1"]) == (ids[1], 2)
    assert store.request("req-2") is not None
    infos = {s.id: s for s in store.sessions()}
    assert infos[ids[0]].events == 3 and infos[ids[0]].requests == 1 and infos[ids[0]].bytes > 0
    assert store.retain(max_bytes=store.size_bytes() - 1) == [ids[0]]  # the oldest goes first
    assert store.request("req-0") is None and store.request("req-1") is not None
    assert sorted(store.retain(max_age_s=0.0)) == sorted(ids[1:])
    assert store._sql.execute("SELECT COUNT(*) FROM blobs").fetchone()[0] == 0
    assert store.integrity() == "ok"


def test_the_store_is_the_owners_alone(tmp_path: Path) -> None:
    path = tmp_path / "fresh" / "sessions.db"
    store = SessionStore(path, "normal")
    sid = store.create("t")
    store.append(sid, [MessageEvent("user", "a secret prompt")])
    modes = {p.name: p.stat().st_mode & 0o777 for p in path.parent.iterdir()}
    assert modes == {"sessions.db": 0o600, "sessions.db-wal": 0o600, "sessions.db-shm": 0o600}
    assert path.parent.stat().st_mode & 0o777 == 0o700
    store.close()
    path.chmod(0o644)  # an older store, opened again, is tightened
    SessionStore(path, "normal").close()
    assert path.stat().st_mode & 0o777 == 0o600
