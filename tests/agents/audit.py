"""What one agent run did to the gateway, from the gateway's own records, and whether
it passes.

The session log gives each request of the run rebuilt from the log (checked
byte for byte against the sha256 recorded when it was sent) and the cached
tokens its answer reported.  From the rebuilt requests comes the prefix each
request shares with any earlier request of the run (sub-agents interleave: the
longest shared prefix, not the previous request), counted in what the target
can reuse of it:

- the local engine: whole KV blocks (vLLM caches whole blocks, and never the
  prompt's last token);
- the Anthropic emulator: whole content blocks (tools, system blocks, message
  blocks as it splits them), from its minimum cacheable prefix on;
- the OpenAI emulator: its automatic prefix cache's steps (1024 tokens, then
  every 128) of its byte stream.

(The emulators count 4 bytes a token of the stream they build from the body;
``loadtests.emulator`` is their definition, used here as is.)  Pass: the agent
exits 0, every request is answered 2xx, each request from the second on reads
at least ``SHARE_FLOOR`` of its reusable prefix from cache, every request
rebuilds, and on the local model the gateway's prediction equals vLLM's count
on every request (its ``vcache_cached_token_predictions`` counter).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loadtests.emulator.anthropic import blocks_of, min_prefix
from loadtests.emulator.openai import OPENAI, chat_stream_bytes, responses_stream_bytes
from loadtests.emulator.state import BYTES_PER_TOKEN, tokens

SHARE_FLOOR = 0.9
BLOCK_SIZE = 128  # vLLM's KV block on CPU


@dataclass(frozen=True)
class Logged:
    """One request of the run as the session log has it."""

    request_id: str
    target: str  # local | provider/model
    rebuilt: bool  # rebuilds to the bytes sent (sha256)
    units: Sequence[Any]  # what a prefix is counted in: token ids, blocks, or bytes
    cached: int | None  # the answer's cached tokens (None: no answer logged)
    prompt_tokens: int | None


def _lcp(a: Sequence[Any], b: Sequence[Any]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def reusable(req: Logged, shared: int, block_size: int) -> int:
    """Tokens of ``shared`` leading units the target could read from its cache."""
    if req.target == "local":
        return min(shared, len(req.units) - 1) // block_size * block_size
    if req.target.startswith("anthropic/"):
        n = sum(tokens(b) for b in req.units[:shared])
        return n if n >= min_prefix(req.target.partition("/")[2]) else 0
    n = shared // BYTES_PER_TOKEN  # the OpenAI emulator's steps
    return 0 if n < OPENAI.minimum else n - (n - OPENAI.minimum) % OPENAI.step


@dataclass(frozen=True)
class Reuse:
    request_id: str
    reusable: int
    cached: int

    @property
    def share(self) -> float:
        return min(1.0, self.cached / self.reusable) if self.reusable else 1.0


def reuse(requests: Sequence[Logged], block_size: int = BLOCK_SIZE) -> list[Reuse]:
    """From the second request on, each one's reusable prefix (longest over the earlier
    requests of the run on the same target) and what it read from cache."""
    out = []
    for i, req in enumerate(requests):
        earlier = [e for e in requests[:i] if e.target == req.target]
        if not earlier or req.cached is None:
            continue
        shared = max(_lcp(req.units, e.units) for e in earlier)
        out.append(Reuse(req.request_id, reusable(req, shared, block_size), req.cached))
    return out


def _units(target: str, data: bytes) -> Sequence[Any]:
    body = json.loads(data)
    if target == "local":
        return list(body["prompt_token_ids"])
    if target.startswith("anthropic/"):
        return [b.data + b"\n" for b in blocks_of(body)]
    return responses_stream_bytes(body) if "input" in body else chat_stream_bytes(body)


class SessionLogReader:
    """The gateway's session log (SQLite file, or PostgreSQL at ``url``), read offline with
    a tokenizer of its own (``model``: the gateway's model; needed for local requests)."""

    def __init__(self, path: Path, model: Path | None, url: str | None = None) -> None:
        from engines.providers.specs import adapter_for
        from engines.tokenizer import ChatTokenizer
        from gateway.sessions.log import SessionLog
        from gateway.sessions.reconstruct import Reconstructor
        from gateway.sessions.store import SessionStore

        tok = None if model is None else ChatTokenizer.from_pretrained(str(model))
        self.store = SessionStore(path, url=url)
        self.log = SessionLog(self.store, Reconstructor(adapter_for, lambda: tok), verify=False)

    def close(self) -> None:
        self.log.close()

    def request_ids(self) -> set[str]:
        return {r.request_id for r in self.store.requests()}

    def read(self, exclude: set[str]) -> list[Logged]:
        """The requests not in ``exclude`` (those logged before the run), in order."""
        from manifest.sessionlog import ResponseEvent

        rows = [r for r in self.store.requests() if r.request_id not in exclude]
        usage: dict[str, dict[str, Any]] = {}
        for sid in {r.session_id for r in rows}:
            for _, e in self.store.events(sid):
                if isinstance(e, ResponseEvent):
                    usage[e.request_id] = dict(e.usage)
        out = []
        for row in rows:
            try:
                event, data = self.log.rebuild(row.session_id, row.seq)
            except Exception:  # a request that does not rebuild at all fails the check
                out.append(Logged(row.request_id, row.target, False, (), None, None))
                continue
            digest = hashlib.sha256(data).hexdigest()
            u = usage.get(row.request_id)
            out.append(
                Logged(
                    row.request_id,
                    row.target,
                    digest == row.sha256 == event.sha256,
                    _units(row.target, data),
                    None if u is None else int(u.get("cached_tokens") or 0),
                    None if u is None else int(u.get("prompt_tokens") or 0),
                )
            )
        return out


@dataclass
class Summary:
    """One run of an agent on a target: what the table shows and what the checks read."""

    agent: str
    version: str
    target: str
    model: str
    exit_codes: list[int | None]
    requests: int  # that the agent made (the tap's count)
    ok: int  # answered 2xx
    gateway_statuses: dict[str, int]  # the gateway's own count: "route status" → n
    failures: list[dict[str, Any]]  # the requests not answered 2xx, with the error body
    logged: int  # requests in the session log
    rebuilt: int
    reuse: list[Reuse]
    predictions: tuple[int, int] | None  # (exact, requests on the local model)
    system_messages: int  # requests carrying a mid-conversation system message
    notes: list[str] = field(default_factory=list)

    @property
    def mean_share(self) -> float | None:
        shares = [r.share for r in self.reuse if r.reusable]
        return sum(shares) / len(shares) if shares else None

    def problems(self) -> list[str]:
        out = []
        for i, rc in enumerate(self.exit_codes, 1):
            if rc != 0:
                out.append(f"step {i} {'timed out' if rc is None else f'exited {rc}'}")
        if len(self.exit_codes) < 2 and all(rc == 0 for rc in self.exit_codes):
            out.append("the follow-up step did not run")
        if self.requests == 0:
            out.append("the agent made no request")
        for f in self.failures:
            out.append(f"{f['method']} {f['path']} answered {f['status']}: {f['error']}")
        for r in self.reuse:
            if r.cached < SHARE_FLOOR * r.reusable:
                out.append(
                    f"{r.request_id} read {r.cached} tokens from cache of {r.reusable} reusable"
                )
        if self.rebuilt != self.logged:
            out.append(f"{self.logged - self.rebuilt} of {self.logged} requests do not rebuild")
        if self.predictions is not None and self.predictions[0] != self.predictions[1]:
            exact, n = self.predictions
            out.append(f"the prediction equals vLLM's cached tokens on {exact} of {n} requests")
        return out

    def row(self) -> dict[str, str]:
        share = self.mean_share
        return {
            "agent": f"{self.agent} {self.version}",
            "target": self.target,
            "requests": str(self.requests),
            "2xx": str(self.ok),
            "cached share": "-" if share is None else f"{share:.1%}",
            "predictions exact": "-"
            if self.predictions is None
            else "{}/{}".format(*self.predictions),
            "rebuilt": f"{self.rebuilt}/{self.logged}",
            "exit": ",".join("timeout" if rc is None else str(rc) for rc in self.exit_codes),
            "verdict": "pass" if not self.problems() else "FAIL",
        }

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["mean_share"] = self.mean_share
        d["problems"] = self.problems()
        return d


def table(summaries: Sequence[Summary]) -> str:
    """The summaries as a fixed-width table."""
    rows = [s.row() for s in summaries]
    if not rows:
        return "(no agent runs)"
    cols = list(rows[0])
    width = {c: max(len(c), *(len(r[c]) for r in rows)) for c in cols}
    line = "  ".join(c.ljust(width[c]) for c in cols)
    out = [line, "  ".join("-" * width[c] for c in cols)]
    out += ["  ".join(r[c].ljust(width[c]) for c in cols) for r in rows]
    return "\n".join(out)
