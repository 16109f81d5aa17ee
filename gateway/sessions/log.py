"""Every request that reaches a model, in the session log (shared/seeds/000).

Sessions are explicit (``x-vcache-session``, or a Responses API conversation
through ``previous_response_id``) or implicit: a stateless chat request whose
system prompt and messages extend an earlier request's (or its answer's)
joins that session; one that diverges from it starts a new one.

Per request: :meth:`SessionLog.open` places it, :meth:`SessionLog.dispatch`
appends the header snapshot and new messages (when they changed) with the
dispatch record — one transaction — and, with ``verify`` on, rebuilds the
request from the store, independently of the live path, and refuses to send
it when the bytes differ.  :meth:`SessionLog.respond` appends the answer and
its usage.  One writer thread (:mod:`gateway.sessions.writer`) does all of
it, in arrival order, committing the appends of the requests waiting at once
in one transaction; a request goes on only after the commit that holds its
events.  Being the only writer, it also keeps concurrent forks of a
conversation from interleaving inside one session.

Images and documents are rebuilt from the store's attachments
(``store.attachments``, stored by intake before the dispatch is journaled);
one missing or corrupt fails the verify with :class:`AttachmentUnreadable`
(a 500 naming ``sha256:<digest>``) and is quarantined (the store records it),
never a rebuild from other bytes.  A request under a LoRA adapter whose weights
were loaded again, changed, between its record and its verify is not sent either
(a 503 ``adapter_changed`` naming the adapter: retried, it records the new weights).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.core.errors import APIError, NotFound, Unavailable
from gateway.sessions.reconstruct import AdapterChanged, Reconstructor, sha256
from gateway.sessions.store import SessionStore
from gateway.sessions.writer import Writer
from manifest.attachments import AttachmentMismatch
from manifest.belief import first_difference
from manifest.canonical import canonical_json
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
    chain,
    changes,
    fold,
    link,
    scoped_session,
    session_name,
)

log = logging.getLogger(__name__)


class ReconstructionMismatch(APIError):
    status = 500
    type = "server_error"


class AttachmentUnreadable(APIError):
    """An attachment object a request references is missing from the store or is not
    the object its reference names: the request is not rebuilt, so not sent."""

    status = 500
    type = "server_error"


@contextlib.asynccontextmanager
async def _store_boundary(what: str) -> AsyncIterator[None]:
    """The one place a failure of the store (its server restarting, the disk full)
    becomes an answer: a 503 with Retry-After.  A request that is not in the log is
    not sent (shared/seeds/000)."""
    try:
        yield
    except APIError:
        raise
    except Exception as exc:
        log.warning("session log: %s failed: %r", what, exc)
        raise Unavailable(
            f"the session log is unavailable ({what} failed); retry shortly",
            code="session_log_unavailable",
            retry_after_s=2,
        ) from exc


@dataclass
class Open:
    """One request's place in the log."""

    tenant: str
    header: Header
    messages: tuple[MessageEvent, ...]
    root: bytes
    explicit: bool
    session_id: str | None = None  # set at dispatch
    dispatch_seq: int | None = None
    answer_seq: int | None = None  # set when the answer is appended
    # chain(root, entries): the system prompts', then the messages' (:func:`_entry`)
    digests: list[str] = field(default_factory=list)
    # how the request found its session (set at dispatch): "named" (a header, an agent's
    # id, a previous response), "found" (by its prefix digests), "new"
    kind: str | None = None

    @property
    def length(self) -> int:
        """The conversation's entries (system prompts and messages)."""
        return len(self.digests) - 1


Key = tuple[str | None, ...]


def _keys(header: Header, messages: tuple[MessageEvent, ...]) -> list[Key]:
    """The conversation's entries, as :func:`_entry` writes each: the system prompts,
    then the messages."""
    return [("system", s) for s in header.system] + [m.key() for m in messages]


def _entry(key: Key) -> bytes:
    return canonical_json(list(key))


class Links:
    """The rolling digests of the conversation entries seen lately: :func:`link` of a
    digest and an entry, remembered (LRU, at most ``chars`` characters of entries held,
    each counted with 128 of its own):
    requests that share a system prompt, or extend a conversation, serialize and hash
    what they repeat once.  An entry is looked up by its fields, never by a digest of
    them: a hit is the same entry after the same digest."""

    def __init__(self, chars: int = 8 << 20) -> None:
        self._seen: OrderedDict[tuple[str, Key], str] = OrderedDict()
        self._chars = chars
        self._held = 0

    def __call__(self, digest: str, key: Key) -> str:
        at = (digest, key)
        hit = self._seen.get(at)
        if hit is not None:
            self._seen.move_to_end(at)
            return hit
        out = self._seen[at] = link(digest, _entry(key))
        self._held += _size(key)
        while self._held > self._chars and len(self._seen) > 1:
            (_, old), _ = self._seen.popitem(last=False)
            self._held -= _size(old)
        return out

    def chain(self, root: bytes, keys: list[Key]) -> list[str]:
        """:func:`manifest.sessionlog.chain` of the entries ``keys`` name."""
        out = chain(root, [])
        for key in keys:
            out.append(self(out[-1], key))
        return out


_ENTRY_CHARS = 128  # what an entry holds besides its fields (its digests, the dict's slot)


def _size(key: Key) -> int:
    """An entry's share of the budget: its fields' characters and its own overhead, so
    that short entries are bounded in number too."""
    return _ENTRY_CHARS + sum(len(v) for v in key if v is not None)


class SessionLog:
    def __init__(
        self, store: SessionStore, rebuild: Reconstructor, verify: bool, cached: int = 4096
    ) -> None:
        self.store = store
        self._rebuild = rebuild
        self.verify = verify
        # Folded states of the sessions this process touched last (LRU, at most ``cached``),
        # each with the last event it folds.  A session that fell out is folded again from
        # the store when it comes back, and its next request records a ``resume`` header
        # snapshot, as after a restart.  Other gateways may append to a session too (a
        # shared log): a cached state behind the store's last event folds the rest in.
        self._states: OrderedDict[str, tuple[int, State]] = OrderedDict()
        self._cached = cached
        self._links = Links()  # on the loop: open and respond
        self.verified = 0
        self.writer = Writer(store, on_abort=self._states.clear)

    def _remember(self, sid: str, seq: int, state: State) -> None:
        self._states[sid] = (seq, state)
        self._states.move_to_end(sid)
        while len(self._states) > self._cached:
            self._states.popitem(last=False)

    async def retain(self, max_age_s: float | None, max_bytes: int | None) -> int:
        """Apply retention (whole sessions); forget the dropped ones.  Returns how many."""

        def retain() -> list[str]:
            dropped = self.store.retain(max_age_s, max_bytes)
            for sid in dropped:
                self._states.pop(sid, None)
            return dropped

        dropped = await self.writer.run(retain, alone=True)
        return len(dropped)

    def open(
        self,
        tenant: str,
        header: Header,
        messages: tuple[MessageEvent, ...],
        session_id: str | None = None,
    ) -> Open:
        root = f"{tenant}\0{header.model}".encode()
        sid = None if session_id is None else scoped_session(tenant, session_id)
        op = Open(tenant, header, messages, root, session_id is not None, sid)
        op.digests = self._links.chain(root, _keys(header, messages))
        return op

    def _state(self, sid: str) -> tuple[int, State]:
        """The session's last event and the session folded through it (call it with the
        session locked: inside the writer's transaction, after
        :meth:`SessionStore.lock_session`)."""
        last = self.store.last_seq(sid)
        cached = self._states.get(sid)
        if cached is not None and cached[0] == last:
            self._states.move_to_end(sid)
            return last, cached[1]
        if cached is not None and cached[0] < last:
            seq, state = cached
            rest = [e for _, e in self.store.events(sid, after_seq=seq)]
            state = fold([_as_header(state), *state.messages, *rest])
        else:
            state = fold(e for _, e in self.store.events(sid))
        self._remember(sid, last, state)
        return last, state

    def _place(self, op: Open) -> tuple[str, list[Event], int | None]:
        """The session, the events that bring it to this request, and the session's last
        event as read under the lock (None: a new session, still to be created)."""
        if op.explicit and op.session_id is not None:
            tenant = self.store.tenant(op.session_id)
            if tenant is not None and tenant != op.tenant:  # unreachable for scoped ids
                raise NotFound(
                    f"Session '{session_name(op.session_id)}' not found",
                    code="session_not_found",
                    param="x-vcache-session",
                )
            sid = self.store.create(op.tenant, op.session_id)
            self.store.lock_session(sid)
            return sid, *self._events_for(sid, op, resume=sid not in self._states)
        found = self.store.find_head(op.tenant, op.digests)
        if found is not None:
            sid = found[0]
            self.store.lock_session(sid)
            resume = sid not in self._states
            events, last = self._events_for(sid, op, resume)
            if not any(isinstance(e, ReplaceEvent | TruncateEvent) for e in events):
                return sid, events, last
        # a new conversation, or a fork of one: a session of its own, created by the append
        sid = scoped_session(op.tenant, f"sess_{uuid.uuid4().hex}")
        return sid, changes(State(), op.header, op.messages), None

    def _events_for(self, sid: str, op: Open, resume: bool) -> tuple[list[Event], int]:
        last, state = self._state(sid)
        events = changes(state, op.header, op.messages)
        if resume and state.header is not None and state.header == op.header:
            events.insert(0, HeaderEvent(op.header, Reason.RESUME))
        return events, last

    async def dispatch(
        self,
        op: Open,
        request_id: str,
        target: str,
        render: Literal["provider", "vllm"],
        directives: Mapping[str, Any],
        sent: bytes,
    ) -> None:
        """Log the request before it is sent; with ``verify``, rebuild it from the store
        and raise :class:`ReconstructionMismatch` when the bytes differ."""
        settings = tuple(sorted(directives.items()))
        heads = [(op.tenant, op.digests[-1], op.length)]

        def append() -> tuple[str, list[int], DispatchEvent]:  # on the writer thread
            sid, events, last = self._place(op)
            new = last is None
            op.kind = "named" if op.explicit else ("new" if new else "found")
            digest = sha256(sent)  # here, not on the loop (a vLLM payload: ~8 KB)
            kind = op.kind
            event = DispatchEvent(request_id, target, render, settings, digest, session_kind=kind)
            events.append(event)
            request = (request_id, target, digest)
            seqs = self.store.append(
                sid, events, request, heads, op.tenant if new else None, last=last
            )
            state = self._states.get(sid, (-1, State()))[1]
            self._remember(sid, seqs[-1], fold([_as_header(state), *state.messages, *events]))
            return sid, seqs, event

        async with _store_boundary("recording the request"):
            sid, seqs, event = await self.writer.run(append)
        op.session_id, op.dispatch_seq = sid, seqs[-1]
        if self.verify:
            async with _store_boundary("verifying the request"):
                await asyncio.to_thread(self._verify, sid, seqs[-1], event, sent)

    def rebuild(self, session_id: str, dispatch_seq: int) -> tuple[DispatchEvent, bytes]:
        """The request a dispatch event sent, rebuilt from the store alone (its
        attachments read back verified: AttachmentMismatch names one that is not)."""
        events = self.store.events(session_id, dispatch_seq)
        seq, last = events[-1]
        if seq != dispatch_seq or not isinstance(last, DispatchEvent):
            raise ValueError(f"event {dispatch_seq} of {session_id} is not a dispatch")
        state = fold(e for _, e in events[:-1])
        return last, self._rebuild.rebuild(state, last, self.store.attachments.get)

    def _verify(self, sid: str, seq: int, event: DispatchEvent, sent: bytes) -> None:
        try:
            _, rebuilt = self.rebuild(sid, seq)
        except AttachmentMismatch as exc:
            log.error("request %s does not rebuild: %s", event.request_id, exc)
            try:
                self.store.quarantine(exc.digest, exc.why, event.request_id)
            except Exception as failed:  # the refusal below is what matters
                log.warning("could not quarantine sha256:%s: %r", exc.digest, failed)
            raise AttachmentUnreadable(
                f"request {event.request_id} was not sent: it does not rebuild from the "
                f"session log ({exc})",
                code="attachment_unreadable",
            ) from exc
        except AdapterChanged as exc:
            log.error("request %s does not rebuild: %s", event.request_id, exc)
            raise Unavailable(
                f"request {event.request_id} was not sent: it does not rebuild from the "
                f"session log ({exc})",
                code="adapter_changed",
                retry_after_s=1,
            ) from exc
        if rebuilt != sent:
            offset = first_difference(rebuilt, sent)
            log.error(
                "request %s does not rebuild from the log (byte %s)", event.request_id, offset
            )
            raise ReconstructionMismatch(
                f"request {event.request_id} was not sent: rebuilt from the session log it "
                f"differs from the live request at byte {offset}",
                code="reconstruction_mismatch",
            )
        self.verified += 1

    async def respond(
        self,
        op: Open,
        request_id: str,
        text: str,
        usage: Mapping[str, Any],
        tool_calls: str | None = None,
        thinking: str | None = None,
    ) -> None:
        """Append the answer (it extends the conversation) and its telemetry.

        Requests of one session may run at once (forks of a Responses conversation):
        if others were appended since this one was dispatched, the session is first
        brought back to this request's messages, so the answer follows its own question
        and a fold up to ``op.answer_seq`` is exactly this conversation."""
        sid = op.session_id
        if sid is None:
            return
        answer = MessageEvent("assistant", text, tool_calls=tool_calls, thinking=thinking)
        tail: list[Event] = [answer, ResponseEvent(request_id, tuple(sorted(usage.items())))]
        heads = [(op.tenant, self._links(op.digests[-1], answer.key()), op.length + 1)]

        def append() -> list[int]:  # on the writer thread
            self.store.lock_session(sid)
            last, state = self._state(sid)
            if last == op.dispatch_seq:  # the session ends at this request's dispatch
                events = tail  # its header and messages are the state's: nothing to fold
                folded = dataclasses.replace(state, messages=(*state.messages, answer))
            else:
                events = [*changes(state, op.header, op.messages), *tail]
                folded = fold([_as_header(state), *state.messages, *events])
            seqs = self.store.append(sid, events, None, heads, last=last)
            self._remember(sid, seqs[-1], folded)
            return seqs

        async with _store_boundary("recording the answer"):
            seqs = await self.writer.run(append)
        op.answer_seq = seqs[-1]

    def close(self) -> None:
        self.writer.close()
        self.store.close()


def _as_header(state: State) -> Event:
    """The cached state as an event prefix (a header snapshot), for incremental folds."""
    if state.header is None:
        return TruncateEvent(0)
    return HeaderEvent(state.header, Reason.RESUME)
