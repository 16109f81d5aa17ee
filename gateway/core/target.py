"""One request shape for every target: a :class:`Call` in, a prepared request out,
journaled once, acquired, sent, settled, released.

::

    edge ──Call──▶ service loop ──▶ target.quote(name, call) ─▶ Quote   (several targets:
                       │                the cheapest goes first, alias order on ties)
                       ├── target.prepare(name, call, quote) ─▶ Prepared
                       │                (decide, render: claims nothing, waits for nothing)
                       ├── journal(prepared.sent)        the session log, before sending
                       ├── target.acquire(prepared) ─▶ Prepared holding its claims
                       │                (what waits: an index sync, room for pins, a running
                       │                 prefill to join, a fan-in hold; traced as a step)
                       ├── target.send(prepared) ─▶ pieces (first piece = first token)
                       ├── target.retry(prepared, error) ─▶ Prepared | None
                       ├── target.settle(prepared, usage)    telemetry into index / belief
                       └── target.release(prepared)     in the loop's ``finally``: every path

Claims are receipts (STYLE 15): what ``acquire`` claims (a prefill registration
siblings wait on, the fan-in hold of a cold anchor) is a value in the Prepared
it returns, and the loop hands every Prepared it held back to ``release``
whatever happened: an answer, an error, a fallback to the next target, a
journal that failed, a client that left.  ``send`` may give a claim back
earlier (a prefill at its first token); ``release`` after it does nothing.

The local replicas and every hosted provider implement :class:`Target`; the loop
(:mod:`gateway.service.loop`) is the only place that journals, falls back and
shapes where a request was served.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, Protocol, TypeVar

from gateway.core.completion_request import TextPrompt
from gateway.core.errors import InvalidRequest
from gateway.core.outputs import Usage
from gateway.core.pieces import Piece
from gateway.core.schemas import ChatCompletionRequest
from gateway.core.tracing import RequestTrace, Tracing
from gateway.core.types import Placement, Principal, RouteOverride
from manifest.sessionlog import Header, MessageEvent

P = TypeVar("P", bound="Prepared")
M = TypeVar("M")  # a target's memo: what it computed to quote, for its prepare


def _untraced() -> RequestTrace:
    return Tracing().request("vcache.untraced")


@dataclass(frozen=True)
class Call:
    """A request as every target serves it: what is asked (a chat, or one prompt of a text
    completion: each is an engine request of its own), by whom, under which request id
    and session, with an admin's routing choice and the request's trace."""

    request: ChatCompletionRequest | TextPrompt
    who: Principal
    request_id: str
    session: str | None = None  # an explicit session-log session (else found or started)
    route: RouteOverride | None = None
    trace: RequestTrace = field(default_factory=_untraced, compare=False)
    warm: bool = False  # prefill only (a provider warm: nothing generated for a client)

    def __repr__(self) -> str:  # prompts never reach logs
        r = self.request
        size = f"messages={len(r.messages)}" if isinstance(r, ChatCompletionRequest) else "text"
        return f"Call({self.request_id}, model={r.model}, {size})"

    @property
    def chat(self) -> ChatCompletionRequest:
        """The chat asked, for a target that serves chats only: a text completion's prompt
        is refused as the edges refuse one for a model with no local target."""
        if isinstance(self.request, ChatCompletionRequest):
            return self.request
        raise InvalidRequest(
            f"text completions are served by the local model only ('{self.request.model}' "
            "was asked of a hosted provider)",
            param="model",
            code="unsupported_model",
        )

    @property
    def text(self) -> TextPrompt:
        """The text completion's prompt asked (the local text target's calls)."""
        if isinstance(self.request, TextPrompt):
            return self.request
        raise TypeError(f"{self!r} is a chat, not a text completion's prompt")


@dataclass(frozen=True)
class Sent:
    """What a target will send, as the session log records it before it is sent."""

    request_id: str
    target: str
    render: Literal["provider", "vllm"]
    directives: Mapping[str, Any]
    body: bytes = field(repr=False)


@dataclass(frozen=True)
class Quote(Generic[M]):
    """What serving a call on one target is expected to cost, known before anything is
    planned or sent: the prompt's tokens, how many the target is expected to read from
    cache (the exact index on the local replicas, the warmth belief on a provider), and
    the target's prices (the uncached input price per million tokens, in the unit the
    deployment chose, and the cache's read price as a multiple of it).

    ``memo``: what the target computed to quote (token ids, a rendered prompt view), of
    the target's own type ``M``, handed back to its ``prepare`` so that nothing is
    rendered twice (None: nothing to hand back).  The loop never reads it."""

    target: str
    prompt_tokens: int
    cached_tokens: float  # expected: a belief's tokens weighed by its probability
    input_price: float
    read_mult: float = 1.0
    memo: M | None = field(default=None, compare=False, repr=False)

    @property
    def rate(self) -> float:
        """The expected price per prompt token: the cached share read, the rest at the
        uncached price (an explicit cache's write premium is left out: it buys the reads
        after it, as every target's cache does, so a cold prefix costs the same
        everywhere).  Targets are compared by it, not by their totals: each estimates the
        prompt's tokens in its own format, and those differences say nothing of cost."""
        if self.prompt_tokens <= 0:
            return self.input_price / 1e6
        share = min(self.cached_tokens / self.prompt_tokens, 1.0)
        return self.input_price * (share * self.read_mult + 1.0 - share) / 1e6

    @property
    def cost(self) -> float:
        """The prompt's expected price."""
        return self.rate * self.prompt_tokens


class Prepared(Protocol):
    """A call planned and rendered for one target; nothing sent yet.  As ``prepare``
    returns it, it holds no claim; as ``acquire`` returns it, it holds the claims its send
    needs, until ``release`` gives them back (the send may give one back sooner)."""

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

    async def quote(self, name: str, call: Call) -> Quote[Any] | None:
        """What ``call`` would cost on target ``name`` now, from what is known (no I/O:
        awaited only for a render off the event loop; no side effects: a target not
        chosen is left as it was); None where it cannot say (not ready, or the call is
        one it refuses: its prepare says why)."""
        ...

    async def prepare(self, name: str, call: Call, quote: Quote[Any] | None = None) -> P:
        """Plan and render ``call`` for target ``name`` (``quote``: this target's, when
        the call was quoted, its memo of the target's own type); errors in the API's
        terms.  Decides only: it claims nothing and waits for nothing (awaited only for a
        render off the event loop), so a call that goes no further (its journal fails, its
        client leaves) leaves nothing behind."""
        ...

    async def acquire(self, prepared: P) -> P:
        """What must wait before ``prepared`` is sent, after it is journaled (an index
        sync, room for pins, a running prefill to join, a fan-in hold), traced as a step
        of its own; ``prepared`` again, holding what it claimed for the send.  An acquire
        that fails or is cancelled has given back what it claimed before it raises."""
        ...

    def send(self, prepared: P, session: str | None) -> AsyncGenerator[Piece, None]:
        """The answer's pieces, the last one carrying only the usage; errors mapped at
        the engine boundary (also while the stream is iterated).  ``session``: the
        session-log session the request was journaled in."""
        ...

    def retry(self, prepared: P, error: Exception) -> P | None:
        """After ``error`` before the first token: the same call prepared again (a
        provider's cached content that is gone: the prompt inline), or None.  It is not
        acquired again: it holds ``prepared``'s claims."""
        ...

    def settle(self, prepared: P, usage: Usage) -> None:
        """Fold the answer's usage telemetry (verify, then account)."""
        ...

    def release(self, prepared: P) -> None:
        """Give back every claim ``prepared`` holds (none before ``acquire``); called on
        every path, once the send has ended or will never run.  Idempotent, and it never
        waits (it runs in ``finally`` blocks, also of a cancelled task)."""
        ...
