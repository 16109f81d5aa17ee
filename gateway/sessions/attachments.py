"""The attachments store: the images and documents requests carried, as immutable
objects keyed by the SHA-256 digest of their bytes (shared/seeds/000: model-visible ⟺
durably referenced).

The session log keeps references (:class:`manifest.attachments.AttachmentRef`:
digest, media type, size, pixel size); the bytes live here, beside the log:

- :class:`FileAttachments`, the embedded default: one file per object under the
  data directory (``<dir>/<digest[:2]>/<digest>``), written to a temporary file and
  renamed into place, so an object is there whole or not at all;
- :class:`SqlAttachments`: a table in the log's PostgreSQL database, so
  active-active gateways share every object.

Contract (:class:`AttachmentStore`):

- ``put`` is idempotent (an object already stored whole is left as it is; one whose
  stored bytes are not its digest's is written again).  Intake stores every object of
  a request before the dispatch event that references it is journaled.
- ``get`` returns the object a reference names, verified against it (digest, size,
  media type, pixel size); a missing or corrupt object raises
  :class:`~manifest.attachments.AttachmentMismatch` naming the digest, and nothing
  is ever rebuilt from other bytes.
- ``sweep`` deletes the objects no retained event references (retention follows the
  log's: :meth:`gateway.sessions.store.SessionStore.retain` calls it), sparing those
  stored after ``before`` (an object stored for a request whose dispatch is not
  journaled yet is not referenced yet).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Protocol

from gateway.sessions.sql import Dialect
from manifest.attachments import Attachment, AttachmentMismatch, AttachmentRef

__all__ = [
    "SWEEP_GRACE_S",
    "AttachmentStore",
    "FileAttachments",
    "SqlAttachments",
]

# an object younger than this is never swept: its request may not be journaled yet
SWEEP_GRACE_S = 3600.0

_DIGEST = re.compile(r"^[0-9a-f]{64}$")


def _digest(digest: str) -> str:
    """``digest`` when it is a hex SHA-256 (it names a file), else AttachmentMismatch."""
    if not _DIGEST.fullmatch(digest):
        raise AttachmentMismatch(digest, "not a sha256 digest")
    return digest


class AttachmentStore(Protocol):
    def put(self, attachment: Attachment) -> None:
        """Store ``attachment`` (idempotent); on return it is durable."""
        ...

    def get(self, ref: AttachmentRef) -> Attachment:
        """The object ``ref`` names, verified; AttachmentMismatch when missing or not it."""
        ...

    def sweep(self, keep: Collection[str], before: float) -> int:
        """Delete the objects stored before ``before`` (wall-clock seconds) whose digest
        is not in ``keep``; how many went."""
        ...

    def close(self) -> None: ...


class FileAttachments:
    """Objects as files under ``root`` (created owner-only: they are prompts)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, digest: str) -> Path:
        d = _digest(digest)
        return self.root / d[:2] / d

    def put(self, attachment: Attachment) -> None:
        ref = attachment.ref
        path = self.path(ref.digest)
        with contextlib.suppress(OSError):
            if hashlib.sha256(path.read_bytes()).hexdigest() == ref.digest:
                return  # already stored whole
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".put-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(attachment.data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)  # whole or not at all
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def get(self, ref: AttachmentRef) -> Attachment:
        try:
            data = self.path(ref.digest).read_bytes()
        except FileNotFoundError:
            raise AttachmentMismatch(ref.digest, "missing from the attachments store") from None
        return Attachment(ref, data).verified()

    def sweep(self, keep: Collection[str], before: float) -> int:
        gone = 0
        if not self.root.is_dir():
            return 0
        for path in self.root.glob("??/*"):
            if path.name in keep or not _DIGEST.fullmatch(path.name):
                continue
            with contextlib.suppress(FileNotFoundError):
                if path.stat().st_mtime < before:
                    path.unlink()
                    gone += 1
        return gone

    def close(self) -> None:
        """Nothing held open."""


class SqlAttachments:
    """Objects as rows of the ``attachments`` table of the log's PostgreSQL database,
    over the log store's connection (``lock`` serializes its users)."""

    def __init__(
        self, sql: Dialect, lock: threading.RLock, clock: Callable[[], float] = time.time
    ) -> None:
        self._sql = sql
        self._lock = lock
        self._clock = clock

    def put(self, attachment: Attachment) -> None:
        r = attachment.ref
        with self._lock:
            row = self._sql.execute(
                "SELECT data FROM attachments WHERE digest = ?", (_digest(r.digest),)
            ).fetchone()
            if row is not None:
                if hashlib.sha256(bytes(row[0])).hexdigest() == r.digest:
                    return  # already stored whole
                self._sql.execute("DELETE FROM attachments WHERE digest = ?", (r.digest,))
            self._sql.execute(
                "INSERT OR IGNORE INTO attachments VALUES (?, ?, ?, ?, ?, ?, ?)",
                (r.digest, r.media_type, r.size, r.width, r.height, attachment.data, self._clock()),
            )

    def get(self, ref: AttachmentRef) -> Attachment:
        with self._lock:
            row = self._sql.execute(
                "SELECT media_type, size, width, height, data FROM attachments WHERE digest = ?",
                (_digest(ref.digest),),
            ).fetchone()
        if row is None:
            raise AttachmentMismatch(ref.digest, "missing from the attachments store")
        media_type, size, width, height, data = row
        if (media_type, size, width, height) != (ref.media_type, ref.size, ref.width, ref.height):
            raise AttachmentMismatch(
                ref.digest,
                f"stored as {media_type}, {size} bytes, {width}x{height}: not what the log says",
            )
        return Attachment(ref, bytes(data)).verified()

    def sweep(self, keep: Collection[str], before: float) -> int:
        with self._lock:
            rows = self._sql.execute(
                "SELECT digest FROM attachments WHERE created < ?", (before,)
            ).fetchall()
            doomed = [(str(d),) for (d,) in rows if d not in keep]
            if doomed:
                self._sql.executemany("DELETE FROM attachments WHERE digest = ?", doomed)
        return len(doomed)

    def close(self) -> None:
        """The log store closes the connection."""
