"""The two databases the session log runs on, and what differs between them.

SQLite (a file, WAL mode) is the embedded default: several processes of one
host may share it, since ``BEGIN IMMEDIATE`` serializes their writers.
PostgreSQL (``session_log.url: postgresql://...``) is the shared log of
active-active gateways on many hosts.  The store writes one SQL text, with
``?`` placeholders and SQLite's ``INSERT OR IGNORE`` / ``INSERT OR REPLACE``;
a :class:`Dialect` turns it into what its database takes, opens and reopens
the connection, and locks a session row for the transaction that appends to
it (SQLite's write lock already covers the whole database).
"""

from __future__ import annotations

import os
import re
import sqlite3
from pathlib import Path
from typing import Any, Literal, Protocol

from gateway.sessions.checkpoint import INTERVAL_S, SAFETY_PAGES, Checkpointer

FsyncPolicy = Literal["full", "normal", "off"]

SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions(
  id TEXT PRIMARY KEY, tenant TEXT NOT NULL, created REAL NOT NULL, updated REAL NOT NULL);
CREATE TABLE IF NOT EXISTS events(
  session_id TEXT NOT NULL, seq INTEGER NOT NULL, data BLOB NOT NULL, created REAL NOT NULL,
  PRIMARY KEY(session_id, seq)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS blobs(digest TEXT PRIMARY KEY, data BLOB NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS blob_refs(
  digest TEXT NOT NULL, session_id TEXT NOT NULL, PRIMARY KEY(digest, session_id)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS requests(
  request_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, seq INTEGER NOT NULL,
  target TEXT NOT NULL, sha256 TEXT NOT NULL, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS heads(
  tenant TEXT NOT NULL, digest TEXT NOT NULL, session_id TEXT NOT NULL, length INTEGER NOT NULL,
  PRIMARY KEY(tenant, digest)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS responses(
  id TEXT PRIMARY KEY, session_id TEXT NOT NULL, seq INTEGER NOT NULL, tenant TEXT NOT NULL,
  body TEXT NOT NULL, stored INTEGER NOT NULL, deleted INTEGER NOT NULL DEFAULT 0,
  created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS attachment_refs(
  digest TEXT NOT NULL, session_id TEXT NOT NULL, size INTEGER NOT NULL,
  PRIMARY KEY(digest, session_id)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS attachment_quarantine(
  digest TEXT NOT NULL, why TEXT NOT NULL, request_id TEXT NOT NULL, created REAL NOT NULL);
CREATE INDEX IF NOT EXISTS requests_by_session ON requests(session_id);
"""

# The attachments store's table where the log is PostgreSQL (gateway/sessions/attachments.py;
# beside a SQLite log the objects are files)
ATTACHMENTS_SCHEMA = """
CREATE TABLE IF NOT EXISTS attachments(
  digest TEXT PRIMARY KEY, media_type TEXT NOT NULL, size INTEGER NOT NULL, width INTEGER,
  height INTEGER, data BLOB NOT NULL, created REAL NOT NULL);
"""

# The conflict target of each table an ``INSERT OR ...`` writes (PostgreSQL names it).
_KEYS = {
    "sessions": "id",
    "blobs": "digest",
    "blob_refs": "digest, session_id",
    "attachment_refs": "digest, session_id",
    "attachments": "digest",
    "heads": "tenant, digest",
}


class Cursor(Protocol):
    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...
    def fetchall(self) -> list[Any]: ...
    def __iter__(self) -> Any: ...


class Dialect(Protocol):
    name: str

    def execute(self, sql: str, args: tuple[Any, ...] = ()) -> Cursor: ...
    def executemany(self, sql: str, rows: list[tuple[Any, ...]]) -> None: ...
    def begin(self) -> None: ...
    def lock_session(self, session_id: str) -> None: ...
    def retryable(self, exc: BaseException) -> bool: ...
    def integrity(self) -> str: ...
    def close(self) -> None: ...


class SQLiteDialect:
    name = "sqlite"

    def __init__(
        self, path: Path, fsync: FsyncPolicy, checkpoint_interval_s: float = INTERVAL_S
    ) -> None:
        # Prompts live here: the folder (when created here) and the file are the owner's
        # alone.  SQLite gives the -wal and -shm files the database file's mode.
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))
        os.chmod(path, 0o600)
        self.path = path
        # timeout: another process's writer (a second worker on this host) holds the lock
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=30)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(f"PRAGMA synchronous={fsync.upper()}")
        # checkpoints run beside the writer (gateway/sessions/checkpoint.py); this
        # connection checkpoints itself only past the bound
        self._db.execute(f"PRAGMA wal_autocheckpoint={SAFETY_PAGES}")
        self._db.executescript(SCHEMA)
        self.checkpointer = Checkpointer(path, fsync.upper(), checkpoint_interval_s)

    def execute(self, sql: str, args: tuple[Any, ...] = ()) -> Cursor:
        return self._db.execute(sql, args)

    def executemany(self, sql: str, rows: list[tuple[Any, ...]]) -> None:
        self._db.executemany(sql, rows)

    def begin(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")  # the database's write lock, across processes

    def lock_session(self, session_id: str) -> None:
        """The write lock taken by :meth:`begin` already covers every session."""

    def retryable(self, exc: BaseException) -> bool:
        return isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc)

    def integrity(self) -> str:
        return str(self._db.execute("PRAGMA integrity_check").fetchone()[0])

    def close(self) -> None:
        self.checkpointer.close()
        self._db.close()  # the last connection: SQLite checkpoints the WAL and removes it


_OR_IGNORE = re.compile(r"INSERT OR IGNORE INTO (\w+) (.*)", re.S)
_OR_REPLACE = re.compile(r"INSERT OR REPLACE INTO (\w+) (.*)", re.S)


def postgres_sql(sql: str) -> str:
    """SQLite's text as PostgreSQL takes it."""
    if m := _OR_IGNORE.fullmatch(sql):
        sql = f"INSERT INTO {m[1]} {m[2]} ON CONFLICT ({_KEYS[m[1]]}) DO NOTHING"
    elif m := _OR_REPLACE.fullmatch(sql):
        assert m[1] == "heads", m[1]
        sql = (
            f"INSERT INTO heads {m[2]} ON CONFLICT (tenant, digest) DO UPDATE SET "
            "session_id = excluded.session_id, length = excluded.length"
        )
    return sql.replace("?", "%s")


def postgres_schema() -> str:
    return (
        (SCHEMA + ATTACHMENTS_SCHEMA)
        .replace(" WITHOUT ROWID", "")
        .replace(" BLOB ", " BYTEA ")
        .replace(" REAL ", " DOUBLE PRECISION ")
    )


class PostgresDialect:
    """One connection (the store serializes its users), reopened after the server or
    the network dropped it: the failed call raises, the next one reconnects."""

    name = "postgres"

    def __init__(self, url: str, fsync: FsyncPolicy) -> None:
        self.url = url
        self._fsync = fsync
        self._conn: Any = None
        conn = self._live()
        with conn.transaction():
            # two gateways starting at once must not race on CREATE TABLE
            conn.execute("SELECT pg_advisory_xact_lock(724001)")
            for stmt in postgres_schema().split(";"):
                if stmt.strip():
                    conn.execute(stmt)

    def _live(self) -> Any:
        if self._conn is None or self._conn.closed or self._conn.broken:
            import psycopg

            conn = psycopg.connect(self.url, autocommit=True, connect_timeout=5)
            # "full" and "normal" wait for the WAL flush: a commit survives the server's
            # crash ("normal" is SQLite's WAL default, which survives the process's);
            # "off" acknowledges before it: a crash may lose the last commits, never
            # corrupt the log
            sync = "off" if self._fsync == "off" else "on"
            conn.execute(f"SET synchronous_commit = {sync}")
            self._conn = conn
        return self._conn

    def execute(self, sql: str, args: tuple[Any, ...] = ()) -> Cursor:
        cur: Cursor = self._live().execute(postgres_sql(sql), args)
        return cur

    def executemany(self, sql: str, rows: list[tuple[Any, ...]]) -> None:
        with self._live().cursor() as cur:
            cur.executemany(postgres_sql(sql), rows)

    def begin(self) -> None:
        self.execute("BEGIN")

    def lock_session(self, session_id: str) -> None:
        # Appends to one session from two gateways take turns: each numbers its events
        # after the other's, and folds the session with them.
        self.execute("SELECT id FROM sessions WHERE id = ? FOR UPDATE", (session_id,))

    def retryable(self, exc: BaseException) -> bool:
        import psycopg.errors

        return isinstance(
            exc, psycopg.errors.DeadlockDetected | psycopg.errors.SerializationFailure
        ) or (isinstance(exc, psycopg.errors.UniqueViolation) and "events_pkey" in str(exc))

    def integrity(self) -> str:
        self.execute("SELECT 1").fetchone()
        return "ok"

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()


def connect(url: str | None, path: Path, fsync: FsyncPolicy) -> Dialect:
    """PostgreSQL for a ``postgresql://`` URL, else the SQLite file at ``path``."""
    if url is not None and url.startswith(("postgresql://", "postgres://")):
        return PostgresDialect(url, fsync)
    if url is not None and not url.startswith("sqlite:///"):
        raise ValueError(f"session_log.url: unsupported scheme in {url!r}")
    return SQLiteDialect(Path(url.removeprefix("sqlite:///")) if url else path, fsync)
