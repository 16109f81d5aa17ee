"""The SQLite session log's WAL checkpoints, on a thread of their own.

In WAL mode each commit appends its pages to the ``-wal`` file, and a
checkpoint copies them back into the database file (with an ``fsync`` under
``fsync: normal`` and ``full``) so that the WAL can start over.  SQLite's
default runs the checkpoint in the connection that commits, inside the commit
that takes the WAL past 1,000 pages: for the session log that is the writer
thread (:mod:`gateway.sessions.writer`), and every request whose record waits
behind that commit waits for the copy and the ``fsync`` too, before it may be
sent.  (``bench_session_log``, 16 requests at once, 1,500 each: a record's wait
p90 was 5.9-6.6 ms with the writer checkpointing at 1,000 pages, 2.5-2.7 ms
when it checkpointed at 10,000, the copies fewer and longer.)

:class:`Checkpointer` runs them beside the writer instead: every
``interval_s`` its own connection runs a ``PASSIVE`` checkpoint, which never
waits for a writer or a reader and copies what no reader still needs; with
nothing new in the WAL it costs a read of the WAL's index.  The writer's
connection still checkpoints itself past :data:`SAFETY_PAGES`, a bound on the
WAL should this thread fall behind.  Several processes sharing one file each
run one; where two checkpoints meet, one finds the other's lock and waits for
its next turn.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from pathlib import Path

log = logging.getLogger(__name__)

INTERVAL_S = 1.0  # between two checkpoints
# the writer's connection checkpoints itself past this many WAL pages (SQLite's
# wal_autocheckpoint; 40 MB at the default 4 KiB page)
SAFETY_PAGES = 10_000


class Checkpointer:
    """A thread that checkpoints the WAL of the SQLite file at ``path`` every
    ``interval_s``, through a connection of its own (``synchronous`` as the writer's:
    what a checkpoint fsyncs).  :meth:`close` stops it."""

    def __init__(self, path: Path, synchronous: str, interval_s: float = INTERVAL_S) -> None:
        # timeout 0: a checkpoint that finds the file locked waits for its next turn,
        # never for the lock
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=0)
        self._db.execute(f"PRAGMA synchronous={synchronous}")
        self._interval_s = interval_s
        self._stop = threading.Event()
        # the last one's (busy, WAL pages, pages checkpointed), as SQLite reports them
        self.last: tuple[int, int, int] | None = None
        self._thread = threading.Thread(
            target=self._loop, name="session-log-checkpoint", daemon=True
        )
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.run()

    def run(self) -> tuple[int, int, int] | None:
        """One PASSIVE checkpoint now; None where the file was locked (another
        process's checkpoint, a schema change)."""
        try:
            busy, pages, copied = self._db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        except sqlite3.OperationalError as exc:
            log.debug("session log: a checkpoint found the file locked: %s", exc)
            return None
        self.last = (int(busy), int(pages), int(copied))
        return self.last

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._db.close()
