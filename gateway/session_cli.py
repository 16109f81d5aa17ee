"""``vcache sessions`` and ``vcache replay``: read the session log offline."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from engines.lora import LoraRef
from engines.providers.specs import adapter_for
from engines.tokenizer import ChatTokenizer
from gateway.core.config import Settings
from gateway.sessions.log import SessionLog
from gateway.sessions.reconstruct import AdapterChanged, Reconstructor, sha256
from gateway.sessions.store import SessionStore
from manifest.attachments import AttachmentMismatch


def _store(settings: Settings, db: Path | None) -> SessionStore:
    cfg = settings.session_log
    path = db or cfg.db_path(settings.data_dir)
    url = None if db else cfg.url  # --db names a SQLite file
    if url is None and not path.exists():
        raise SystemExit(f"no session log at {path}")
    return SessionStore(path, cfg.fsync, url=url)


def list_sessions(settings: Settings, db: Path | None, limit: int) -> int:
    store = _store(settings, db)
    rows = store.sessions()[:limit]
    print(f"{'session':<40} {'tenant':<12} {'events':>7} {'requests':>9} {'bytes':>10}  updated")
    for s in rows:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(s.updated))
        print(f"{s.id:<40} {s.tenant:<12} {s.events:>7} {s.requests:>9} {s.bytes:>10}  {when}")
    print(f"{len(rows)} of {len(store.sessions())} sessions; store {store.size_bytes()} bytes")
    store.close()
    return 0


def replay(settings: Settings, db: Path | None, request_id: str, quiet: bool) -> int:
    """Print the request rebuilt from the log and its sha256; 1 when it does not match,
    or when an image or document it references is missing from the attachments store or
    is not the object the log names (the error names its digest: nothing is rebuilt from
    other bytes), or when the LoRA adapter it ran under has other weights now or is
    gone (the error names the adapter)."""
    store = _store(settings, db)
    row = store.request(request_id)
    if row is None:
        print(f"no request {request_id!r} in the log", file=sys.stderr)
        return 2

    def tokenizer() -> ChatTokenizer:
        from gateway.local.build import resolve_model

        return ChatTokenizer.from_pretrained(resolve_model(settings))

    from gateway.local.adapters import weights_digest
    from gateway.local.build import vision_rebuild

    def weights(adapter: LoraRef) -> str | None:
        return weights_digest(adapter.path)

    rebuild = Reconstructor(adapter_for, tokenizer, vision_rebuild(settings), weights)
    log = SessionLog(store, rebuild, verify=False)
    try:
        event, data = log.rebuild(row.session_id, row.seq)
    except (AttachmentMismatch, AdapterChanged) as exc:
        print(f"request  {request_id}  session {row.session_id}  target {row.target}")
        print(f"MISMATCH: the request does not rebuild: {exc}", file=sys.stderr)
        store.close()
        return 1
    digest = sha256(data)
    if not quiet:
        sys.stdout.write(data.decode(errors="replace") + "\n")
    print(f"request  {request_id}  session {row.session_id}  target {row.target}")
    print(f"sha256   {digest}")
    print(f"recorded {row.sha256}")
    ok = digest == row.sha256 == event.sha256
    print("match: the log rebuilds what was sent" if ok else "MISMATCH")
    store.close()
    return 0 if ok else 1
