"""The session log as both request paths use it (shared/seeds/000).

Journal before anything is claimed: a request's place in the log is opened,
and what will be sent is recorded (and, with verification on, rebuilt from
the log and compared) after it is planned and rendered, and before anything
waits or is claimed for it (the target's ``acquire``: a local request is
routed then) or sent; the answer is appended when it ends.  A record that
fails (503 ``session_log_unavailable``) leaves nothing claimed to give back.
Where a request was logged (its session, its answer's sequence) the loop reads off
the :class:`~gateway.sessions.log.Open` it opened.  Without a session log every call
here is a no-op.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from gateway.core.outputs import Usage
from gateway.core.samples import Sample
from gateway.core.schemas import tool_calls_json
from gateway.sessions.log import Open, SessionLog
from gateway.sessions.render import usage_record
from manifest.canonical import canonical_json
from manifest.sessionlog import Header, MessageEvent


class Journal:
    def __init__(self, log: SessionLog | None) -> None:
        self.log = log

    def open(
        self,
        tenant: str,
        header: Header,
        turns: tuple[MessageEvent, ...],
        session: str | None,
    ) -> Open | None:
        return None if self.log is None else self.log.open(tenant, header, turns, session)

    async def sent(
        self,
        op: Open | None,
        request_id: str,
        target: str,
        render: Literal["provider", "vllm"],
        directives: Mapping[str, Any],
        body: bytes,
    ) -> None:
        """Record (and verify) the request before it is sent."""
        if self.log is None or op is None:
            return
        await self.log.dispatch(op, request_id, target, render, directives, body)

    async def answered(
        self,
        op: Open | None,
        request_id: str,
        text: str,
        usage: Usage,
        tool_calls: str | None = None,
        thinking: str | None = None,
    ) -> None:
        """Append the answer: its text and (canonical JSON) the tools it called and the
        thinking blocks it wrote."""
        if self.log is None or op is None:
            return
        record = usage_record(usage)
        await self.log.respond(op, request_id, text, record, tool_calls, thinking)

    async def sampled(self, op: Open | None, request_id: str, answer: Sample, usage: Usage) -> None:
        """Append the answer a conversation goes on with (sample 0): its text, the tools it
        called and its thinking blocks."""
        calls = answer.tool_calls()
        called = tool_calls_json([c.model_dump() for c in calls]) if calls else None
        blocks = answer.thinking_blocks()
        thinking = canonical_json(blocks).decode() if blocks else None
        await self.answered(op, request_id, "".join(answer.text), usage, called, thinking)
