"""The session log's store: append-only events, content-addressed blobs.

SQLite in WAL mode is the embedded default; PostgreSQL is the shared log of
active-active gateways (:mod:`gateway.sessions.sql` holds what differs).

One transaction per append: the events of a request (header snapshot,
messages, dispatch), its request row and its conversation heads land
together or not at all, so a writer killed at any point leaves a store that
opens cleanly with every acknowledged (committed) request whole.  Long
strings are stored once as sha256-addressed blobs shared by every session
that references them.  ``fsync``: ``full`` (every commit reaches the disk),
``normal`` (WAL default: a power cut may lose the last commits, never
corrupt) or ``off``.  Retention deletes whole sessions, oldest first, then
every blob no remaining session references.

Images and documents are not events: they live in the attachments store
(:mod:`gateway.sessions.attachments`; files beside a SQLite log, a table of a
PostgreSQL one), which this store opens beside itself as ``attachments``.  An
append records which objects its messages reference (``attachment_refs``), and
retention deletes the objects no remaining session references.  An object found
missing or corrupt is quarantined (``attachment_quarantine``: its digest, why,
and the request that needed it); nothing is rebuilt from other bytes, and the
same bytes put again (a client sending the image again) repair it.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.sessions.attachments import (
    SWEEP_GRACE_S,
    AttachmentStore,
    FileAttachments,
    SqlAttachments,
)
from gateway.sessions.sql import Dialect, FsyncPolicy, connect
from manifest.sessionlog import Event, attachment_refs, decode, encode

__all__ = [
    "FsyncPolicy",
    "Quarantined",
    "RequestRow",
    "ResponseRow",
    "SessionInfo",
    "SessionStore",
]

_LOOKUP_CHUNK = 500  # digests per IN (...) query, well under SQLite's variable limit


@dataclass(frozen=True)
class RequestRow:
    request_id: str
    session_id: str
    seq: int
    target: str
    sha256: str


@dataclass(frozen=True)
class ResponseRow:
    id: str
    session_id: str
    seq: int
    tenant: str
    body: str
    stored: bool
    deleted: bool


@dataclass(frozen=True)
class Quarantined:
    digest: str
    why: str
    request_id: str
    created: float


@dataclass(frozen=True)
class SessionInfo:
    id: str
    tenant: str
    events: int
    requests: int
    bytes: int  # event bytes plus the blobs and attachment objects it references
    created: float
    updated: float  # when its last request was recorded (its dispatch)


class SessionStore:
    def __init__(
        self,
        path: Path,
        fsync: FsyncPolicy = "normal",
        url: str | None = None,
        clock: Callable[[], float] = time.time,
        attachments: AttachmentStore | None = None,
    ) -> None:
        """``clock``: the wall clock (seconds) of the sessions' and responses' times and
        of retention's cutoff.  ``attachments``: the attachments store; by default the
        log's own (files in ``attachments/`` beside a SQLite file, a table of a
        PostgreSQL log)."""
        self._sql: Dialect = connect(url, path, fsync)
        self._clock = clock
        self.path = path
        self._lock = threading.RLock()
        self._batch = False  # inside a group commit (:meth:`batch`): appends join it
        if attachments is None:
            if self._sql.name == "postgres":
                attachments = SqlAttachments(self._sql, self._lock, clock)
            else:
                db = Path(url.removeprefix("sqlite:///")) if url else path
                attachments = FileAttachments(db.parent / "attachments")
        self.attachments: AttachmentStore = attachments

    def close(self) -> None:
        with self._lock:
            self.attachments.close()
            self._sql.close()

    def retryable(self, exc: BaseException) -> bool:
        """A transaction that lost a race with another process's (a deadlock, a lock
        timeout): running it again may succeed."""
        return self._sql.retryable(exc)

    def lock_session(self, session_id: str) -> None:
        """Inside a transaction: appends of other processes to this session wait."""
        self._sql.lock_session(session_id)

    def last_seq(self, session_id: str) -> int:
        """The session's last event (-1: none)."""
        with self._lock:
            row = self._sql.execute(
                "SELECT COALESCE(MAX(seq), -1) FROM events WHERE session_id = ?", (session_id,)
            ).fetchone()
        return int(row[0])

    @contextlib.contextmanager
    def batch(self) -> Iterator[Callable[[], contextlib.AbstractContextManager[None]]]:
        """One transaction for several writers' appends (a group commit): yields ``item``,
        a savepoint per writer (its failure rolls back its writes only).  Readers wait
        until the commit; a failed commit rolls everything back and raises."""
        with self._lock:
            db = self._sql
            db.begin()
            self._batch = True
            try:
                yield self._savepoint
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
            finally:
                self._batch = False

    @contextlib.contextmanager
    def _savepoint(self) -> Iterator[None]:
        self._sql.execute("SAVEPOINT item")
        try:
            yield
        except BaseException:
            self._sql.execute("ROLLBACK TO item")
            raise
        finally:
            self._sql.execute("RELEASE item")

    # ----------------------------------------------------------------- writes

    def create(self, tenant: str, session_id: str | None = None) -> str:
        sid = session_id or f"sess_{uuid.uuid4().hex}"
        now = self._clock()
        with self._lock:
            self._sql.execute(
                "INSERT OR IGNORE INTO sessions VALUES (?, ?, ?, ?)", (sid, tenant, now, now)
            )
        return sid

    def append(
        self,
        session_id: str,
        events: Sequence[Event],
        request: tuple[str, str, str] | None = None,
        heads: Sequence[tuple[str, str, int]] = (),
        new_for: str | None = None,
        last: int | None = None,
    ) -> list[int]:
        """Append in one transaction; returns the events' sequence numbers.

        ``request``: (request id, target, sha256) of the last event (a dispatch); the
        session's ``updated`` time moves with it (not with an answer: one statement and
        one page of the commit fewer, and retention's age is counted in days).
        ``heads``: (tenant, digest, length) conversation heads of this session.
        ``new_for``: the session does not exist yet; it is created for this tenant in
        the same transaction, its events numbered from 0.
        ``last``: the session's last event as the caller read it in this transaction,
        with the session locked (:meth:`lock_session`, :meth:`last_seq`); not read again.
        """
        if last is not None and not self._batch:
            raise ValueError("a last event read in this transaction, outside a batch")
        now = self._clock()
        with self._lock:
            db = self._sql
            own = not self._batch  # alone: a transaction of its own
            if own:
                db.begin()
            try:
                if new_for is not None:
                    db.execute(
                        "INSERT INTO sessions VALUES (?, ?, ?, ?)", (session_id, new_for, now, now)
                    )
                    first = 0
                elif last is not None:
                    first = last + 1
                else:
                    db.lock_session(session_id)
                    first = self.last_seq(session_id) + 1
                seqs = list(range(first, first + len(events)))
                rows, blobs = [], {}
                for seq, e in zip(seqs, events, strict=True):
                    enc = encode(e)
                    blobs.update(enc.blobs)
                    rows.append((session_id, seq, enc.data, now))
                if blobs:
                    db.executemany("INSERT OR IGNORE INTO blobs VALUES (?, ?)", list(blobs.items()))
                    db.executemany(
                        "INSERT OR IGNORE INTO blob_refs VALUES (?, ?)",
                        [(digest, session_id) for digest in blobs],
                    )
                shown = attachment_refs(events)
                if shown:
                    db.executemany(
                        "INSERT OR IGNORE INTO attachment_refs VALUES (?, ?, ?)",
                        [(d, session_id, shown[d].size) for d in sorted(shown)],
                    )
                db.executemany("INSERT INTO events VALUES (?, ?, ?, ?)", rows)
                last = seqs[-1] if seqs else first - 1
                if request is not None:
                    rid, target, sha = request
                    db.execute(
                        "INSERT INTO requests VALUES (?, ?, ?, ?, ?, ?)",
                        (rid, session_id, last, target, sha, now),
                    )
                if heads:
                    db.executemany(
                        "INSERT OR REPLACE INTO heads VALUES (?, ?, ?, ?)",
                        [(tenant, digest, session_id, length) for tenant, digest, length in heads],
                    )
                if new_for is None and request is not None:  # an answer leaves it as it was
                    db.execute("UPDATE sessions SET updated = ? WHERE id = ?", (now, session_id))
                if own:
                    db.execute("COMMIT")
            except BaseException:
                if own:
                    db.execute("ROLLBACK")
                raise
        return seqs

    def add_response(
        self, response_id: str, session_id: str, seq: int, tenant: str, body: str, stored: bool
    ) -> None:
        """A Responses API response at event ``seq`` of its session (its answer, whatever
        was appended to the session since), in one statement."""
        with self._lock:
            self._sql.execute(
                "INSERT INTO responses VALUES (?, ?, ?, ?, ?, ?, 0, ?)",
                (response_id, session_id, seq, tenant, body, int(stored), self._clock()),
            )

    def delete_response(self, response_id: str) -> bool:
        with self._lock:
            cur = self._sql.execute(
                "UPDATE responses SET deleted = 1 WHERE id = ? AND deleted = 0", (response_id,)
            )
            return cur.rowcount == 1

    # ------------------------------------------------------------------ reads

    def _blob(self, digest: str) -> bytes:
        row = self._sql.execute("SELECT data FROM blobs WHERE digest = ?", (digest,)).fetchone()
        if row is None:
            raise KeyError(f"blob {digest} is missing")
        return bytes(row[0])

    def events(
        self, session_id: str, upto_seq: int | None = None, after_seq: int = -1
    ) -> list[tuple[int, Event]]:
        """Events in order, after ``after_seq`` and through ``upto_seq`` when given."""
        with self._lock:
            rows = self._sql.execute(
                "SELECT seq, data FROM events WHERE session_id = ? AND seq > ? AND seq <= ? "
                "ORDER BY seq",
                (session_id, after_seq, upto_seq if upto_seq is not None else 1 << 62),
            ).fetchall()
            return [(int(seq), decode(bytes(data), self._blob)) for seq, data in rows]

    def tenant(self, session_id: str) -> str | None:
        with self._lock:
            row = self._sql.execute(
                "SELECT tenant FROM sessions WHERE id = ?", (session_id,)
            ).fetchone()
        return None if row is None else str(row[0])

    def request(self, request_id: str) -> RequestRow | None:
        with self._lock:
            row = self._sql.execute(
                "SELECT request_id, session_id, seq, target, sha256 FROM requests "
                "WHERE request_id = ?",
                (request_id,),
            ).fetchone()
        return None if row is None else RequestRow(*row)

    def requests(self, session_id: str | None = None) -> list[RequestRow]:
        q = "SELECT request_id, session_id, seq, target, sha256 FROM requests"
        args: tuple[Any, ...] = ()
        if session_id is not None:
            q, args = q + " WHERE session_id = ?", (session_id,)
        with self._lock:
            return [RequestRow(*r) for r in self._sql.execute(q + " ORDER BY created", args)]

    def find_head(self, tenant: str, digests: Sequence[str]) -> tuple[str, int] | None:
        """The conversation head among ``digests`` that comes last in the list (the
        longest prefix of a conversation): (session, length)."""
        found: dict[str, tuple[str, int]] = {}
        with self._lock:
            for at in range(0, len(digests), _LOOKUP_CHUNK):
                chunk = digests[at : at + _LOOKUP_CHUNK]
                marks = ", ".join("?" * len(chunk))
                for digest, sid, length in self._sql.execute(
                    "SELECT digest, session_id, length FROM heads "
                    f"WHERE tenant = ? AND digest IN ({marks})",
                    (tenant, *chunk),
                ):
                    found[digest] = (str(sid), int(length))
        return next((found[d] for d in reversed(digests) if d in found), None)

    def response(self, response_id: str) -> ResponseRow | None:
        with self._lock:
            row = self._sql.execute(
                "SELECT id, session_id, seq, tenant, body, stored, deleted FROM responses "
                "WHERE id = ?",
                (response_id,),
            ).fetchone()
        if row is None:
            return None
        return ResponseRow(row[0], row[1], row[2], row[3], row[4], bool(row[5]), bool(row[6]))

    def sessions(self) -> list[SessionInfo]:
        with self._lock:
            rows = self._sql.execute(
                """
                SELECT s.id, s.tenant,
                  (SELECT COUNT(*) FROM events e WHERE e.session_id = s.id),
                  (SELECT COUNT(*) FROM requests r WHERE r.session_id = s.id),
                  (SELECT COALESCE(SUM(LENGTH(e.data)), 0) FROM events e
                     WHERE e.session_id = s.id)
                  + (SELECT COALESCE(SUM(LENGTH(b.data)), 0) FROM blob_refs f
                     JOIN blobs b ON b.digest = f.digest WHERE f.session_id = s.id)
                  + (SELECT COALESCE(SUM(a.size), 0) FROM attachment_refs a
                     WHERE a.session_id = s.id),
                  s.created, s.updated
                FROM sessions s ORDER BY s.updated DESC
                """
            ).fetchall()
        return [SessionInfo(*r) for r in rows]

    def size_bytes(self) -> int:
        with self._lock:
            ev = self._sql.execute("SELECT COALESCE(SUM(LENGTH(data)), 0) FROM events").fetchone()
            bl = self._sql.execute("SELECT COALESCE(SUM(LENGTH(data)), 0) FROM blobs").fetchone()
            at = self._sql.execute(
                "SELECT COALESCE(SUM(size), 0) FROM "
                "(SELECT DISTINCT digest, size FROM attachment_refs) AS objects"
            ).fetchone()
        return int(ev[0]) + int(bl[0]) + int(at[0])

    def integrity(self) -> str:
        with self._lock:
            return self._sql.integrity()

    # -------------------------------------------------------------- retention

    def retain(self, max_age_s: float | None = None, max_bytes: int | None = None) -> list[str]:
        """Delete whole sessions (oldest first) older than ``max_age_s`` or until the store
        holds at most ``max_bytes``; then the blobs nothing references, and the attachment
        objects no remaining session references (stored before the sweep's grace: see
        :mod:`gateway.sessions.attachments`).  Returns their ids."""
        doomed: list[str] = []
        infos = sorted(self.sessions(), key=lambda s: s.updated)
        if max_age_s is not None:
            cutoff = self._clock() - max_age_s
            doomed += [s.id for s in infos if s.updated < cutoff]
        if max_bytes is not None:
            total = self.size_bytes()
            for s in infos:
                if total <= max_bytes:
                    break
                if s.id not in doomed:
                    doomed.append(s.id)
                total -= s.bytes
        with self._lock:
            db = self._sql
            db.begin()
            try:
                for sid in doomed:
                    for table, col in (
                        ("events", "session_id"),
                        ("requests", "session_id"),
                        ("heads", "session_id"),
                        ("responses", "session_id"),
                        ("blob_refs", "session_id"),
                        ("attachment_refs", "session_id"),
                        ("sessions", "id"),
                    ):
                        db.execute(f"DELETE FROM {table} WHERE {col} = ?", (sid,))
                db.execute("DELETE FROM blobs WHERE digest NOT IN (SELECT digest FROM blob_refs)")
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        self.attachments.sweep(self.attachment_digests(), self._clock() - SWEEP_GRACE_S)
        return doomed

    def quarantine(self, digest: str, why: str, request_id: str) -> None:
        """Record that the attachment object ``digest`` was missing or corrupt when
        ``request_id`` needed it (the request was not sent)."""
        with self._lock:
            self._sql.execute(
                "INSERT INTO attachment_quarantine VALUES (?, ?, ?, ?)",
                (digest, why, request_id, self._clock()),
            )

    def quarantined(self) -> list[Quarantined]:
        with self._lock:
            rows = self._sql.execute(
                "SELECT digest, why, request_id, created FROM attachment_quarantine "
                "ORDER BY created"
            ).fetchall()
        return [Quarantined(*r) for r in rows]

    def attachment_digests(self) -> set[str]:
        """The attachment objects the retained sessions reference."""
        with self._lock:
            rows = self._sql.execute("SELECT DISTINCT digest FROM attachment_refs").fetchall()
        return {str(d) for (d,) in rows}
