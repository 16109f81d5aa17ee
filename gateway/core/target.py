"""One request shape for every target: a :class:`Call` in, a prepared request out,
journaled once, sent, settled.

::

    edge ──Call──▶ service loop ──▶ target.prepare(name, call) ─▶ Prepared
                       │                (plan, render: sends nothing)
                       ├── journal(prepared.sent)        the session log, before sending
                       ├── target.send(prepared) ─▶ pieces (first piece = first token)
                       ├── target.retry(prepared, error) ─▶ Prepared | None
                       └── target.settle(prepared, usage)    telemetry into index / belief

The local replicas and every hosted provider implement :class:`Target`; the loop
(:mod:`gateway.service.loop`) is the only place that journals, falls back and
shapes where a request was served.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

from gateway.core.outputs import Usage
from gateway.core.schemas import ChatCompletionRequest
from gateway.core.shaping import Piece
from gateway.core.tracing import RequestTrace, Tracing
from gateway.core.types import Placement, Principal, RouteOverride
from manifest.sessionlog import Header, MessageEvent

P = TypeVar("P", bound="Prepared")


def _untraced() -> RequestTrace:
    return Tracing().request("vcache.untraced")


@dataclass(frozen=True)
class Call:
    """A chat request as every target serves it: what is asked, by whom, under which
    request id and session, with an admin's routing choice and the request's trace."""

    request: ChatCompletionRequest
    who: Principal
    request_id: str
    session: str | None = None  # an explicit session-log session (else found or started)
    route: RouteOverride | None = None
    trace: RequestTrace = field(default_factory=_untraced, compare=False)
    warm: bool = False  # prefill only (a provider warm: nothing generated for a client)

    def __repr__(self) -> str:  # prompts never reach logs
        n = len(self.request.messages)
        return f"Call({self.request_id}, model={self.request.model}, messages={n})"


@dataclass(frozen=True)
class Sent:
    """What a target will send, as the session log records it before it is sent."""

    request_id: str
    target: str
    render: Literal["provider", "vllm"]
    directives: Mapping[str, Any]
    body: bytes = field(repr=False)


class Prepared(Protocol):
    """A call planned and rendered for one target; nothing sent yet."""

    @property
    def target(self) -> str: ...

    @property
    def header(self) -> Header: ...

    @property
    def turns(self) -> tuple[MessageEvent, ...]: ...

    @property
    def sent(self) -> Sent: ...

    @property
    def placement(self) -> Placement | None: ...

    @property
    def notes(self) -> Mapping[str, str]:
        """What the response headers say of how it was prepared (lint, breakpoints...)."""
        ...


class Target(Protocol[P]):
    """Something that serves chat calls: the local replicas, or a hosted provider's
    models (``name`` says which target of the alias)."""

    def admission(self, call: Call) -> AbstractContextManager[None]:
        """Held from before prepare until the answer ends; refuses when full (a lower
        priority first)."""
        ...

    async def prepare(self, name: str, call: Call) -> P:
        """Plan and render ``call`` for target ``name``; errors in the API's terms."""
        ...

    def send(self, prepared: P, session: str | None) -> AsyncGenerator[Piece, None]:
        """The answer's pieces, the last one carrying only the usage; errors mapped at
        the engine boundary (also while the stream is iterated).  ``session``: the
        session-log session the request was journaled in."""
        ...

    def retry(self, prepared: P, error: Exception) -> P | None:
        """After ``error`` before the first token: the same call prepared again (a
        provider's cached content that is gone: the prompt inline), or None."""
        ...

    def settle(self, prepared: P, usage: Usage) -> None:
        """Fold the answer's usage telemetry (verify, then account)."""
        ...
