"""The session log's SQLite store under a writer killed by SIGKILL in the middle of its
appends (a process of its own): every append it acknowledged is in the log, whole."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.sessions.store import SessionStore
from manifest.sessionlog import DispatchEvent, fold

pytestmark = pytest.mark.processes


WRITER = """
import sys
sys.path.insert(0, {repo!r})
from gateway.sessions.store import SessionStore
from manifest.sessionlog import DispatchEvent, Header, HeaderEvent, MessageEvent, Reason
store = SessionStore(__import__("pathlib").Path({db!r}), "full")
h = Header.make("m", "local", ["system " * 40])
sid = store.create("t")
store.append(sid, [HeaderEvent(h, Reason.INITIAL)])
i = 0
while True:
    rid = f"req-{{i}}"
    d = DispatchEvent(rid, "local", "vllm", (), f"{{i:064x}}")
    events = [MessageEvent("user", f"question {{i}} " * 30), d]
    store.append(sid, events, (rid, "local", f"{{i:064x}}"))
    print(rid, flush=True)  # acknowledged: committed
    i += 1
"""


def test_a_writer_killed_mid_append_leaves_every_acknowledged_request(tmp_path: Path) -> None:
    db = tmp_path / "killed.db"
    repo = str(Path(__file__).resolve().parents[2])
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER.format(repo=repo, db=str(db))],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": repo},
    )
    assert proc.stdout is not None
    acked: list[str] = []
    while len(acked) < 200:
        line = proc.stdout.readline()
        assert line, "the writer died on its own"
        acked.append(line.strip())
    os.kill(proc.pid, signal.SIGKILL)  # in the middle of the next appends
    proc.wait()
    acked += [line.strip() for line in proc.stdout.read().splitlines() if line.strip()]
    proc.stdout.close()
    store = SessionStore(db)
    assert store.integrity() == "ok"
    rows = {r.request_id: r for r in store.requests()}
    assert set(acked) <= set(rows)
    for rid in acked:
        row = rows[rid]
        events = store.events(row.session_id, row.seq)
        state = fold(e for _, e in events[:-1])
        assert isinstance(events[-1][1], DispatchEvent) and events[-1][1].request_id == rid
        assert state.header is not None and state.messages[-1].content.startswith("question")
    print(f"\nkill -9 after {len(acked)} acknowledged appends: store ok, all rebuilt")
    assert json.dumps([len(acked), len(rows)])
    store.close()
