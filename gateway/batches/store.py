"""Batch state, durable: the files a batch reads and writes, the batches, and their items.

The tables live on the session log's database (:mod:`gateway.sessions.sql`'s
:class:`Dialect`): a SQLite file beside the log (``batches.db``) for the embedded
default, the log's own PostgreSQL database when ``session_log.url`` names one, so
active-active gateways share batches.  Every method is one short transaction, safe
from any thread (a lock serializes this process's users of the one connection).

An item moves ``pending → running → done | error``, or ``pending → canceled |
expired``.  :meth:`BatchStore.claim` takes a pending item, or a running one whose
lease has run out (its gateway died or was restarted), for ``lease_s`` seconds; its
owner renews the lease while the item runs (:meth:`BatchStore.renew`) and writes the
result with :meth:`BatchStore.finish`, which moves the item to done only if the owner
still holds it.  So a restart resumes a batch without re-running done items: an
item's result is written in the same statement that makes it done.

A batch is ``in_progress`` until every item has settled, then ``completed``
(``cancelling`` → ``cancelled`` after a cancel); :meth:`BatchStore.finalize` makes
that move once, with the batch's output and error files, whichever gateway gets there
first.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from gateway.sessions.sql import Dialect, FsyncPolicy, connect

Api = Literal["openai", "anthropic"]
ItemState = Literal["pending", "running", "done", "error", "canceled", "expired"]
ACTIVE = ("in_progress", "cancelling")  # the statuses the runner works on
ENDED = ("completed", "cancelled", "expired", "failed")

SCHEMA = """
CREATE TABLE IF NOT EXISTS batch_files(
  id TEXT PRIMARY KEY, tenant TEXT NOT NULL, purpose TEXT NOT NULL, filename TEXT NOT NULL,
  bytes INTEGER NOT NULL, created REAL NOT NULL, data BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS batches(
  id TEXT PRIMARY KEY, api TEXT NOT NULL, tenant TEXT NOT NULL, key_name TEXT NOT NULL,
  endpoint TEXT NOT NULL, model TEXT NOT NULL, status TEXT NOT NULL, input_file_id TEXT,
  output_file_id TEXT, error_file_id TEXT, metadata TEXT NOT NULL, plan TEXT NOT NULL,
  created REAL NOT NULL, expires REAL NOT NULL, in_progress_at REAL, finalizing_at REAL,
  ended_at REAL, cancelling_at REAL, deleted INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS batch_items(
  batch_id TEXT NOT NULL, idx INTEGER NOT NULL, custom_id TEXT NOT NULL, body TEXT NOT NULL,
  state TEXT NOT NULL, owner TEXT, lease_until REAL, status_code INTEGER, result TEXT,
  input_tokens INTEGER NOT NULL DEFAULT 0, cached_tokens INTEGER NOT NULL DEFAULT 0,
  output_tokens INTEGER NOT NULL DEFAULT 0, finished REAL,
  bought_tokens INTEGER NOT NULL DEFAULT 0, PRIMARY KEY(batch_id, idx));
CREATE INDEX IF NOT EXISTS batches_by_tenant ON batches(tenant, api, created);
CREATE TABLE IF NOT EXISTS batch_provider_runs(
  id TEXT PRIMARY KEY, batch_id TEXT NOT NULL, target TEXT NOT NULL, items TEXT NOT NULL,
  state TEXT NOT NULL, created REAL NOT NULL, kind TEXT, lookup TEXT);
CREATE INDEX IF NOT EXISTS batch_provider_runs_by_batch ON batch_provider_runs(batch_id, state);
CREATE TABLE IF NOT EXISTS batch_hit_shares(
  target TEXT NOT NULL, kind TEXT NOT NULL, hits REAL NOT NULL, reads REAL NOT NULL,
  PRIMARY KEY(target, kind));
"""


def _schema(dialect: str) -> list[str]:
    text = SCHEMA
    if dialect == "postgres":
        text = text.replace(" BLOB ", " BYTEA ").replace(" REAL", " DOUBLE PRECISION")
    return [s for s in text.split(";") if s.strip()]


@dataclass(frozen=True)
class FileRow:
    id: str
    tenant: str
    purpose: str
    filename: str
    bytes: int
    created: float


@dataclass(frozen=True)
class Counts:
    """A batch's items by state."""

    total: int = 0
    pending: int = 0
    running: int = 0
    done: int = 0
    error: int = 0
    canceled: int = 0
    expired: int = 0


@dataclass(frozen=True)
class BatchUsage:
    """The usage of a batch's finished items (``input`` includes ``cached``; ``bought``:
    the cached tokens the send order bought, see :mod:`gateway.batches.cost`)."""

    input: int = 0
    cached: int = 0
    output: int = 0
    bought: int = 0


@dataclass(frozen=True)
class BatchRow:
    id: str
    api: Api
    tenant: str
    key_name: str
    endpoint: str
    model: str
    status: str
    input_file_id: str | None
    output_file_id: str | None
    error_file_id: str | None
    metadata: dict[str, str] | None
    plan: dict[str, Any]
    created: float
    expires: float
    in_progress_at: float | None
    finalizing_at: float | None
    ended_at: float | None
    cancelling_at: float | None
    counts: Counts = field(default_factory=Counts)
    totals: BatchUsage = field(default_factory=BatchUsage)

    @property
    def ended(self) -> bool:
        return self.status in ENDED


@dataclass(frozen=True)
class ItemRow:
    idx: int
    custom_id: str
    body: str  # the request body, JSON text
    state: ItemState
    status_code: int | None = None
    result: dict[str, Any] | None = None  # see :class:`gateway.batches.send.Outcome`


@dataclass(frozen=True)
class ProviderRun:
    """A submission to a provider's own batch API: its id there (``id``; while ``state``
    is ``submitting``, the token it is looked up by: the create may not have answered),
    the vcache batch and target, and the items it carries (index → what the session log
    recorded of the request sent for it: ``request_id``, ``session_id``)."""

    id: str
    batch_id: str
    target: str
    items: dict[int, dict[str, str | None]]
    state: str  # submitting, running, ended
    kind: str | None = None  # the hit-share kind it measures ("5m", "1h", "implicit")
    lookup: dict[str, Any] = field(default_factory=dict)  # how a lost create is found

    @property
    def submitting(self) -> bool:
        """Kept before its create: whether the provider made the batch is not known."""
        return self.state == "submitting"


@dataclass(frozen=True)
class NewItem:
    custom_id: str
    body: str  # JSON text


def _times(values: Sequence[Any]) -> tuple[float | None, float | None, float | None, float | None]:
    a, b, c, d = (None if v is None else float(v) for v in values)
    return a, b, c, d


_BATCH_COLS = (
    "id, api, tenant, key_name, endpoint, model, status, input_file_id, output_file_id, "
    "error_file_id, metadata, plan, created, expires, in_progress_at, finalizing_at, "
    "ended_at, cancelling_at"
)


class BatchStore:
    def __init__(
        self,
        path: Path,
        fsync: FsyncPolicy = "normal",
        url: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``path``: the SQLite file (unless ``url`` is the session log's PostgreSQL);
        ``clock``: wall seconds for the batches' times and the items' leases."""
        pg = url is not None and url.startswith(("postgresql://", "postgres://"))
        self._sql: Dialect = connect(url if pg else None, path, fsync)
        self._clock = clock
        self._lock = threading.Lock()
        with self._lock:
            for stmt in _schema(self._sql.name):
                self._sql.execute(stmt)
            self._add_column("batch_items", "bought_tokens", "INTEGER NOT NULL DEFAULT 0")
            self._add_column("batch_provider_runs", "lookup", "TEXT")
            # a batch's counts and token totals (every GET of it, which SDKs poll) read
            # from this index alone: from the items' rows, whose bodies come first, a
            # 10,000-item batch took ~30 ms a GET under the store's one lock (~4 ms so)
            self._sql.execute(
                "CREATE INDEX IF NOT EXISTS batch_items_totals ON batch_items(batch_id, "
                "state, input_tokens, cached_tokens, output_tokens, bought_tokens)"
            )
            self._sql.execute("DROP INDEX IF EXISTS batch_items_by_state")  # its prefix

    def _add_column(self, table: str, column: str, decl: str) -> None:
        """A store made before ``table.column`` was: the column added."""
        if self._sql.name == "postgres":
            self._sql.execute(f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {column} {decl}")
            return
        cols = {r[1] for r in self._sql.execute(f"PRAGMA table_info({table})").fetchall()}
        if column not in cols:
            self._sql.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")

    @classmethod
    def beside(cls, log_path: Path, fsync: FsyncPolicy, url: str | None) -> BatchStore:
        """The store of a session log at ``log_path`` (or ``url``): its PostgreSQL
        database, else ``batches.db`` beside its SQLite file."""
        if url is not None and url.startswith("sqlite:///"):
            log_path = Path(url.removeprefix("sqlite:///"))
        return cls(log_path.parent / "batches.db", fsync, url)

    def close(self) -> None:
        with self._lock:
            self._sql.close()

    def now(self) -> float:
        return self._clock()

    @contextmanager
    def _tx(self) -> Iterator[Dialect]:
        with self._lock:
            db = self._sql
            db.begin()
            try:
                yield db
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    def _one(self, sql: str, args: tuple[Any, ...]) -> Any:
        with self._lock:
            return self._sql.execute(sql, args).fetchone()

    def _all(self, sql: str, args: tuple[Any, ...]) -> list[Any]:
        with self._lock:
            return list(self._sql.execute(sql, args).fetchall())

    # ------------------------------------------------------------------ files

    def add_file(self, tenant: str, purpose: str, filename: str, data: bytes) -> FileRow:
        row = FileRow(
            f"file-{uuid.uuid4().hex[:24]}", tenant, purpose, filename, len(data), self.now()
        )
        with self._tx() as db:
            self._insert_file(db, row, data)
        return row

    @staticmethod
    def _insert_file(db: Dialect, row: FileRow, data: bytes) -> None:
        db.execute(
            "INSERT INTO batch_files(id, tenant, purpose, filename, bytes, created, data) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            (row.id, row.tenant, row.purpose, row.filename, row.bytes, row.created, data),
        )

    def file(self, tenant: str, file_id: str) -> FileRow | None:
        r = self._one(
            "SELECT id, tenant, purpose, filename, bytes, created FROM batch_files "
            "WHERE id = ? AND tenant = ?",
            (file_id, tenant),
        )
        return None if r is None else FileRow(r[0], r[1], r[2], r[3], int(r[4]), float(r[5]))

    def file_content(self, tenant: str, file_id: str) -> bytes | None:
        r = self._one("SELECT data FROM batch_files WHERE id = ? AND tenant = ?", (file_id, tenant))
        return None if r is None else bytes(r[0])

    # ---------------------------------------------------------------- batches

    def create(
        self,
        api: Api,
        tenant: str,
        key_name: str,
        endpoint: str,
        model: str,
        items: Sequence[NewItem],
        *,
        window_s: float,
        metadata: dict[str, str] | None = None,
        plan: dict[str, Any] | None = None,
        input_file_id: str | None = None,
    ) -> BatchRow:
        """A new batch of ``items``, in progress (its items pending)."""
        prefix = "msgbatch_" if api == "anthropic" else "batch_"
        bid = f"{prefix}{uuid.uuid4().hex[:24]}"
        now = self.now()
        with self._tx() as db:
            db.execute(
                f"INSERT INTO batches({_BATCH_COLS}) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    bid,
                    api,
                    tenant,
                    key_name,
                    endpoint,
                    model,
                    "in_progress",
                    input_file_id,
                    None,
                    None,
                    json.dumps(metadata),
                    json.dumps(plan or {}),
                    now,
                    now + window_s,
                    now,
                    None,
                    None,
                    None,
                ),
            )
            db.executemany(
                "INSERT INTO batch_items(batch_id, idx, custom_id, body, state) "
                "VALUES (?, ?, ?, ?, 'pending')",
                [(bid, i, it.custom_id, it.body) for i, it in enumerate(items)],
            )
        found = self.batch(bid)
        assert found is not None
        return found

    def batch(
        self, batch_id: str, tenant: str | None = None, api: Api | None = None
    ) -> BatchRow | None:
        """The batch (None: no such batch, another tenant's or API's, or deleted)."""
        r = self._one(
            f"SELECT {_BATCH_COLS} FROM batches WHERE id = ? AND deleted = 0", (batch_id,)
        )
        if r is None or (tenant is not None and r[2] != tenant) or (api and r[1] != api):
            return None
        return self._row(r)

    def _row(self, r: Any) -> BatchRow:
        states = dict(
            self._all(
                "SELECT state, COUNT(*) FROM batch_items WHERE batch_id = ? GROUP BY state",
                (r[0],),
            )
        )
        counts = Counts(
            sum(int(v) for v in states.values()), **{k: int(v) for k, v in states.items()}
        )
        t = self._one(
            "SELECT COALESCE(SUM(input_tokens), 0), COALESCE(SUM(cached_tokens), 0), "
            "COALESCE(SUM(output_tokens), 0), COALESCE(SUM(bought_tokens), 0) "
            "FROM batch_items WHERE batch_id = ?",
            (r[0],),
        )
        return BatchRow(
            r[0],
            r[1],
            r[2],
            r[3],
            r[4],
            r[5],
            r[6],
            r[7],
            r[8],
            r[9],
            json.loads(r[10]),
            json.loads(r[11]),
            float(r[12]),
            float(r[13]),
            *_times(r[14:18]),
            counts=counts,
            totals=BatchUsage(int(t[0]), int(t[1]), int(t[2]), int(t[3])),
        )

    def page(
        self, tenant: str, api: Api, limit: int, after: str | None = None, before: str | None = None
    ) -> tuple[list[BatchRow], bool]:
        """A tenant's batches of ``api``, newest first: up to ``limit`` older than
        ``after`` (or newer than ``before``), and whether there are more."""
        where, args = "tenant = ? AND api = ? AND deleted = 0", [tenant, api]
        order = "DESC"
        for cursor, op in ((after, "<"), (before, ">")):
            if cursor is None:
                continue
            mark = self._one("SELECT created, id FROM batches WHERE id = ?", (cursor,))
            if mark is None:
                return [], False
            where += f" AND (created {op} ? OR (created = ? AND id {op} ?))"
            args += [mark[0], mark[0], mark[1]]
            order = "DESC" if op == "<" else "ASC"
        rows = self._all(
            f"SELECT {_BATCH_COLS} FROM batches WHERE {where} ORDER BY created {order}, "
            f"id {order} LIMIT ?",
            (*args, limit + 1),
        )
        more = len(rows) > limit
        rows = rows[:limit]
        if order == "ASC":
            rows.reverse()
        return [self._row(r) for r in rows], more

    def active(self) -> list[str]:
        """Every batch the runners work on (in progress or cancelling), oldest first."""
        rows = self._all(
            "SELECT id FROM batches WHERE status IN (?, ?) AND deleted = 0 ORDER BY created, id",
            ACTIVE,
        )
        return [str(r[0]) for r in rows]

    def status(self, batch_id: str) -> str | None:
        r = self._one("SELECT status FROM batches WHERE id = ?", (batch_id,))
        return None if r is None else str(r[0])

    def cancel(self, batch_id: str, tenant: str, api: Api) -> BatchRow | None:
        """Stop a batch's new items (pending ones are canceled; running ones finish);
        the batch is ``cancelling`` until they have.  An ended batch is left as it is."""
        now = self.now()
        with self._tx() as db:
            r = db.execute(
                "SELECT status FROM batches WHERE id = ? AND tenant = ? AND api = ? "
                "AND deleted = 0",
                (batch_id, tenant, api),
            ).fetchone()
            if r is None:
                return None
            if r[0] == "in_progress":
                db.execute(
                    "UPDATE batches SET status = 'cancelling', cancelling_at = ? WHERE id = ?",
                    (now, batch_id),
                )
                db.execute(
                    "UPDATE batch_items SET state = 'canceled', finished = ? "
                    "WHERE batch_id = ? AND state = 'pending'",
                    (now, batch_id),
                )
        return self.batch(batch_id)

    def delete(self, batch_id: str, tenant: str, api: Api) -> bool:
        """Delete an ended batch and its items (False: no such batch of the tenant's)."""
        with self._tx() as db:
            n = db.execute(
                "UPDATE batches SET deleted = 1 WHERE id = ? AND tenant = ? AND api = ? "
                "AND deleted = 0",
                (batch_id, tenant, api),
            ).rowcount
            if n:
                db.execute("DELETE FROM batch_items WHERE batch_id = ?", (batch_id,))
        return bool(n)

    def expire(self) -> list[str]:
        """Items still pending in batches past their window are expired; the batches."""
        now = self.now()
        with self._tx() as db:
            ids = [
                str(r[0])
                for r in db.execute(
                    "SELECT id FROM batches WHERE status = 'in_progress' AND expires < ? "
                    "AND deleted = 0",
                    (now,),
                ).fetchall()
            ]
            for bid in ids:
                db.execute(
                    "UPDATE batch_items SET state = 'expired', finished = ? "
                    "WHERE batch_id = ? AND state = 'pending'",
                    (now, bid),
                )
        return ids

    def cached_tokens(self, batch_id: str) -> dict[int, int]:
        """Each settled item's cached prompt tokens, by index."""
        rows = self._all(
            "SELECT idx, cached_tokens FROM batch_items WHERE batch_id = ? "
            "AND state IN ('done', 'error')",
            (batch_id,),
        )
        return {int(r[0]): int(r[1]) for r in rows}

    def abandon(self) -> int:
        """Items a dead owner left running in a cancelled batch are canceled once their
        lease has run out (no runner takes an item of a batch no longer in progress, so
        the batch would never settle); an item a provider's batch carries is left to the
        runner that reads that batch's results.  How many."""
        now = self.now()
        with self._tx() as db:
            ids = [
                str(r[0])
                for r in db.execute(
                    "SELECT id FROM batches WHERE status = 'cancelling' AND deleted = 0", ()
                ).fetchall()
            ]
            n = 0
            for bid in ids:
                carried = {
                    int(k)
                    for r in db.execute(
                        "SELECT items FROM batch_provider_runs WHERE batch_id = ? "
                        "AND state IN ('submitting', 'running')",
                        (bid,),
                    ).fetchall()
                    for k in json.loads(r[0])
                }
                stale = [
                    int(r[0])
                    for r in db.execute(
                        "SELECT idx FROM batch_items WHERE batch_id = ? AND state = 'running' "
                        "AND lease_until < ?",
                        (bid, now),
                    ).fetchall()
                    if int(r[0]) not in carried
                ]
                for idx in stale:
                    n += int(
                        db.execute(
                            "UPDATE batch_items SET state = 'canceled', finished = ?, "
                            "owner = NULL, lease_until = NULL WHERE batch_id = ? AND idx = ? "
                            "AND state = 'running' AND lease_until < ?",
                            (now, bid, idx, now),
                        ).rowcount
                    )
        return n

    # ------------------------------------------------------------------ items

    def items(self, batch_id: str) -> list[ItemRow]:
        """A batch's items in input order, with their results."""
        rows = self._all(
            "SELECT idx, custom_id, body, state, status_code, result FROM batch_items "
            "WHERE batch_id = ? ORDER BY idx",
            (batch_id,),
        )
        return [
            ItemRow(
                int(r[0]),
                r[1],
                r[2],
                r[3],
                None if r[4] is None else int(r[4]),
                None if r[5] is None else json.loads(r[5]),
            )
            for r in rows
        ]

    def claim(
        self, batch_id: str, idx: int, owner: str, lease_s: float, resume: bool = False
    ) -> bool:
        """Take the item for ``lease_s`` seconds: a pending one, or a running one whose
        lease has run out, of a batch in progress (``resume``: or cancelling, for an item
        a provider's batch carries: its results are read and the cancel passed on).
        False: settled, or another owner holds it."""
        now = self.now()
        statuses = ACTIVE if resume else ("in_progress",)
        marks = ", ".join("?" for _ in statuses)
        with self._tx() as db:
            n = db.execute(
                "UPDATE batch_items SET state = 'running', owner = ?, lease_until = ? "
                "WHERE batch_id = ? AND idx = ? AND (state = 'pending' OR "
                "(state = 'running' AND lease_until < ?)) AND EXISTS (SELECT 1 FROM batches "
                f"WHERE id = ? AND status IN ({marks}))",
                (owner, now + lease_s, batch_id, idx, now, batch_id, *statuses),
            ).rowcount
        return n == 1

    def renew(self, owner: str, lease_s: float) -> int:
        """Extend the leases of every item ``owner`` runs; how many."""
        with self._tx() as db:
            return int(
                db.execute(
                    "UPDATE batch_items SET lease_until = ? WHERE owner = ? AND state = 'running'",
                    (self.now() + lease_s, owner),
                ).rowcount
            )

    def finish(
        self,
        batch_id: str,
        idx: int,
        owner: str,
        ok: bool,
        status_code: int,
        result: dict[str, Any],
        usage: BatchUsage,
    ) -> bool:
        """Write the item's result and settle it (done, or error), if ``owner`` still holds
        it.  False: its lease ran out and another owner took it."""
        with self._tx() as db:
            n = db.execute(
                "UPDATE batch_items SET state = ?, status_code = ?, result = ?, "
                "input_tokens = ?, cached_tokens = ?, output_tokens = ?, bought_tokens = ?, "
                "finished = ?, "
                "owner = NULL, lease_until = NULL "
                "WHERE batch_id = ? AND idx = ? AND owner = ? AND state = 'running'",
                (
                    "done" if ok else "error",
                    status_code,
                    json.dumps(result),
                    usage.input,
                    usage.cached,
                    usage.output,
                    usage.bought,
                    self.now(),
                    batch_id,
                    idx,
                    owner,
                ),
            ).rowcount
        return n == 1

    def drop(
        self,
        batch_id: str,
        idx: int,
        owner: str,
        state: Literal["canceled", "expired"] = "canceled",
    ) -> bool:
        """Settle a claimed item without a result, if ``owner`` still holds it: canceled
        (its batch was cancelled while it waited to be sent again, or the provider's
        batch carrying it was cancelled first) or expired (the provider's batch window
        ran out first)."""
        with self._tx() as db:
            n = db.execute(
                "UPDATE batch_items SET state = ?, finished = ?, owner = NULL, "
                "lease_until = NULL WHERE batch_id = ? AND idx = ? AND owner = ? "
                "AND state = 'running'",
                (state, self.now(), batch_id, idx, owner),
            ).rowcount
        return n == 1

    def release(self, batch_id: str, idxs: Sequence[int], owner: str) -> int:
        """Give claimed items back where ``owner`` still holds them: pending again, for
        any runner to take (canceled if the batch is no longer in progress); how many."""
        now = self.now()
        with self._tx() as db:
            r = db.execute("SELECT status FROM batches WHERE id = ?", (batch_id,)).fetchone()
            going = r is not None and r[0] == "in_progress"
            state, finished = ("pending", None) if going else ("canceled", now)
            return sum(
                int(
                    db.execute(
                        "UPDATE batch_items SET state = ?, finished = ?, owner = NULL, "
                        "lease_until = NULL WHERE batch_id = ? AND idx = ? AND owner = ? "
                        "AND state = 'running'",
                        (state, finished, batch_id, idx, owner),
                    ).rowcount
                )
                for idx in idxs
            )

    # ----------------------------------------------------- provider batch runs

    def add_provider_run(
        self,
        run_id: str,
        batch_id: str,
        target: str,
        items: Mapping[int, Mapping[str, str | None]],
        kind: str | None = None,
        lookup: Mapping[str, Any] | None = None,
    ) -> None:
        """Keep a submission to ``target``'s batch API and the items it carries before it
        is made: ``run_id`` the token it is looked up by, ``lookup`` what else finds it
        (state ``submitting`` until :meth:`submitted` names its id at the provider), so a
        restart finds or makes it rather than submit it twice."""
        carried = json.dumps({str(k): dict(v) for k, v in items.items()})
        with self._tx() as db:
            db.execute(
                "INSERT INTO batch_provider_runs(id, batch_id, target, items, state, created, "
                "kind, lookup) VALUES (?, ?, ?, ?, 'submitting', ?, ?, ?)",
                (run_id, batch_id, target, carried, self.now(), kind, json.dumps(lookup or {})),
            )

    def submitted(self, token: str, run_id: str) -> bool:
        """The submission kept as ``token`` is the provider's batch ``run_id``: running
        there, polled under that id.  False: no such submission waits for its id."""
        with self._tx() as db:
            n = db.execute(
                "UPDATE batch_provider_runs SET id = ?, state = 'running' "
                "WHERE id = ? AND state = 'submitting'",
                (run_id, token),
            ).rowcount
        return n == 1

    def forget_provider_run(self, token: str) -> bool:
        """Remove a submission the provider never made (still ``submitting``): its items
        are sent again like any open item."""
        with self._tx() as db:
            n = db.execute(
                "DELETE FROM batch_provider_runs WHERE id = ? AND state = 'submitting'", (token,)
            ).rowcount
        return n == 1

    def provider_runs(self, batch_id: str) -> list[ProviderRun]:
        """The batch's submissions not ended (submitting or running), oldest first."""
        rows = self._all(
            "SELECT id, batch_id, target, items, state, kind, lookup FROM batch_provider_runs "
            "WHERE batch_id = ? AND state IN ('submitting', 'running') ORDER BY created, id",
            (batch_id,),
        )
        return [
            ProviderRun(
                r[0],
                r[1],
                r[2],
                {int(k): v for k, v in json.loads(r[3]).items()},
                r[4],
                r[5],
                json.loads(r[6]) if r[6] else {},
            )
            for r in rows
        ]

    def end_provider_run(self, run_id: str) -> bool:
        """Mark the submission ended if every item it carries has settled (a restart that
        took over only some of them leaves it running for the rest).  Whether it ended."""
        with self._tx() as db:
            r = db.execute(
                "SELECT batch_id, items FROM batch_provider_runs WHERE id = ?", (run_id,)
            ).fetchone()
            if r is None:
                return False
            carried = {int(k) for k in json.loads(r[1])}
            open_ = {
                int(x[0])
                for x in db.execute(
                    "SELECT idx FROM batch_items WHERE batch_id = ? "
                    "AND state IN ('pending', 'running')",
                    (r[0],),
                ).fetchall()
            }
            if carried & open_:
                return False
            db.execute("UPDATE batch_provider_runs SET state = 'ended' WHERE id = ?", (run_id,))
        return True

    def add_hit_share(self, target: str, kind: str, hits: float, reads: float) -> None:
        """Add a finished provider batch's measure to ``target``'s: of ``reads`` items that
        could read their anchor, ``hits`` did (each counted by the share it read)."""
        with self._tx() as db:
            n = db.execute(
                "UPDATE batch_hit_shares SET hits = hits + ?, reads = reads + ? "
                "WHERE target = ? AND kind = ?",
                (hits, reads, target, kind),
            ).rowcount
            if n == 0:
                db.execute(
                    "INSERT INTO batch_hit_shares(target, kind, hits, reads) VALUES (?, ?, ?, ?)",
                    (target, kind, hits, reads),
                )

    def hit_shares(self) -> dict[tuple[str, str], tuple[float, float]]:
        """Every (target, kind)'s measure so far: (hits, reads)."""
        rows = self._all("SELECT target, kind, hits, reads FROM batch_hit_shares", ())
        return {(str(r[0]), str(r[1])): (float(r[2]), float(r[3])) for r in rows}

    # --------------------------------------------------------------- finalize

    def settled(self, batch_id: str) -> bool:
        """No item of the batch is pending or running."""
        r = self._one(
            "SELECT COUNT(*) FROM batch_items WHERE batch_id = ? "
            "AND state IN ('pending', 'running')",
            (batch_id,),
        )
        return int(r[0]) == 0

    def finalize(
        self,
        batch_id: str,
        files: Callable[[BatchRow, list[ItemRow]], tuple[bytes | None, bytes | None]],
    ) -> bool:
        """End a settled batch once: ``in_progress`` → ``completed`` (``expired`` when its
        window ran out first), ``cancelling`` → ``cancelled``, with the output and error
        files ``files(batch, items)`` makes (None: no such file).  False: not settled,
        or another gateway ended it first."""
        batch = self.batch(batch_id)
        if batch is None or batch.status not in ACTIVE or not self.settled(batch_id):
            return False
        output, errors = files(batch, self.items(batch_id))
        now = self.now()
        if batch.status == "cancelling":
            to = "cancelled"
        else:
            to = "expired" if batch.counts.expired else "completed"
        with self._tx() as db:
            n = db.execute(
                "UPDATE batches SET status = ?, finalizing_at = ?, ended_at = ? "
                "WHERE id = ? AND status = ?",
                (to, now, now, batch_id, batch.status),
            ).rowcount
            if n != 1:
                return False
            for col, data, name in (
                ("output_file_id", output, "output"),
                ("error_file_id", errors, "error"),
            ):
                if data is None:
                    continue
                row = FileRow(
                    f"file-{uuid.uuid4().hex[:24]}",
                    batch.tenant,
                    "batch_output",
                    f"{batch_id}_{name}.jsonl",
                    len(data),
                    now,
                )
                self._insert_file(db, row, data)
                db.execute(f"UPDATE batches SET {col} = ? WHERE id = ?", (row.id, batch_id))
        return True
