"""The hosted providers as a :class:`~gateway.core.target.Target`.

prepare: split the request into a header and turns (the session log's
shapes, :mod:`gateway.sessions.render`), let the provider path plan the cache
and render it once (nothing waits, nothing is claimed) → the service loop
journals the exact bytes → acquire (the ``fan_in`` step): a sibling of a
cold anchor waits for the first one's answer to begin, and the first holds
the :class:`~gateway.providers.control.Fan` the others wait on → send: the
provider's deltas as answer pieces → retry: a cached-content handle the
provider no longer knows (a false warm) is dropped and the call prepared
again inline, journaled as its own dispatch → settle: the usage telemetry
into the belief (verify, then account) → release: the fan given back (its
siblings go), whatever happened (also when the send never ran).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, aclosing
from dataclasses import dataclass

from engines.errors import EngineError
from engines.providers.base import ChatCall, Delta, ProviderUsage
from engines.providers.errors import ProviderNotFound
from gateway.core.errors import APIError, InvalidRequest, from_engine_error
from gateway.core.metrics import Metrics
from gateway.core.outputs import Usage
from gateway.core.pieces import Piece, Pieces, ToolCallDelta
from gateway.core.schemas import ChatCompletionRequest
from gateway.core.target import Call, Quote, Sent
from gateway.providers.book import PromptView
from gateway.providers.path import PlannedCall, ProviderPath
from gateway.providers.targets import ProviderTarget
from gateway.sessions.render import (
    SystemLayouts,
    directives_of,
    provider_call,
    request_attachments,
    request_config,
    request_parts,
)
from manifest.sessionlog import Header, MessageEvent

# a call as the log keeps it (its header and turns), the provider-neutral call, its lint
_Parts = tuple[Header, tuple[MessageEvent, ...], ChatCall, list[str]]
_Memo = tuple[_Parts, PromptView]  # a quote's: the parts and the prompt's plain view


def usage_of(u: ProviderUsage | None) -> Usage:
    """The provider's reported usage in the API's terms (zeros, with no cache writes
    stated, when it reported none: :func:`reported` reads that back)."""
    if u is None:
        return Usage.of(0, 0, 0)
    return Usage.of(u.prompt_tokens, u.completion_tokens, u.cached_tokens, u.cache_write_tokens)


def reported(u: Usage) -> ProviderUsage | None:
    """What :func:`usage_of` was given: the provider's usage (None when it reported none,
    the one case its cache writes are not stated)."""
    written = u.prompt_tokens_details.cache_write_tokens
    if written is None:
        return None
    cached = u.prompt_tokens_details.cached_tokens
    return ProviderUsage(u.prompt_tokens, cached, written, u.completion_tokens)


def _local_only_parameters(req: ChatCompletionRequest) -> None:
    """What hosted-provider targets do not take yet (an alias falls back past them)."""
    asked = {
        "n": req.n > 1,
        "logprobs": bool(req.logprobs),
        "response_format": req.structured() is not None,
        "logit_bias": bool(req.logit_bias),
        "echo": req.echo,
        "continuous_usage_stats": bool(
            req.stream_options and req.stream_options.continuous_usage_stats
        ),
        **req.vllm_asked(),
        **{k: True for k in req.template()},  # prompt shaping: the local template's
    }
    for param, on in asked.items():
        if on:
            raise InvalidRequest(
                f"{param} is served by the local model only, not by hosted-provider targets",
                param=param,
                code="unsupported_on_target",
            )


def _piece(d: Delta) -> Piece:
    """A provider's delta as an answer piece (its usage is the last piece, apart)."""
    parts = tuple(ToolCallDelta(c.index, c.id, c.name, c.arguments) for c in d.tool_calls)
    return Piece(
        d.text,
        d.finish_reason,
        tool_calls=parts,
        thinking=d.thinking,
        stop_sequence=d.stop_sequence,
    )


class _Timing:
    """TTFT and inter-token latency of one provider answer (labels: model, target)."""

    def __init__(self, metrics: Metrics, model: str, target: str, t0: float) -> None:
        self._ttft = metrics.ttft.labels("chat", model, target, "")
        self._itl = metrics.inter_token.labels(model, target, "")
        self._last: float | None = None
        self._t0 = t0

    def output(self) -> None:
        now = time.perf_counter()
        if self._last is None:
            self._ttft.observe(now - self._t0)
        else:
            self._itl.observe(now - self._last)
        self._last = now


@dataclass(frozen=True)
class ProviderPrepared:
    """A chat call planned and rendered for one provider target."""

    call: Call
    target: str
    planned: PlannedCall
    header: Header
    turns: tuple[MessageEvent, ...]
    request_id: str
    t0: float
    lint: tuple[str, ...] = ()
    placement: None = None

    @property
    def sent(self) -> Sent:
        body = self.planned.rendered.body
        return Sent(
            self.request_id, self.target, "provider", directives_of(self.planned.directives), body
        )

    @property
    def notes(self) -> dict[str, str]:
        out = {}
        if self.lint:
            out["x-vcache-prefix-lint"] = ", ".join(self.lint)
        if self.planned.placed_by is not None:
            out["x-vcache-breakpoints"] = self.planned.placed_by
        return out


class ProviderChat:
    """Every configured provider's models as one :class:`~gateway.core.target.Target`."""

    def __init__(self, path: ProviderPath, layout: str, metrics: Metrics) -> None:
        self.path = path
        self.metrics = metrics
        self.layout = layout
        self.layouts = SystemLayouts()

    def admission(self, call: Call) -> AbstractContextManager[None]:
        return contextlib.nullcontext()  # providers shed load themselves (429, 529)

    @contextlib.contextmanager
    def _failures(self, t: ProviderTarget) -> Iterator[None]:
        """A call to ``t`` that fails (planning or sending) is counted, and its engine
        error mapped to the API's terms, once."""
        try:
            yield
        except Exception as exc:
            self.path.failed(t)
            if isinstance(exc, EngineError):
                raise from_engine_error(exc) from exc
            raise

    def _call(self, name: str, call: Call) -> _Parts:
        """The header and turns the log keeps, the provider-neutral call, its lint."""
        req = call.chat
        _local_only_parameters(req)
        if not name.startswith("anthropic/"):
            req.hints.refuse_anthropic_only(name)
        system, turns = request_parts(req)
        config = request_config(req, self.layout)
        header = Header.make(req.model, name, system, req.tool_dicts(), config)
        chat, lint = provider_call(header, turns, self.layouts, request_attachments(req))
        return header, turns, chat, lint

    async def quote(self, name: str, call: Call) -> Quote[_Memo] | None:
        """The prompt's estimated tokens and those believed warm (weighed by the belief's
        probability), at the target's prices: nothing planned, nothing counted."""
        try:
            t = self.path.target(name)
            parts = self._call(name, call)
        except APIError:
            return None  # its prepare says what is wrong, in the API's terms
        view = self.path.view(t, parts[2], call.who.tenant)
        believed = self.path.book.believed(view)
        cached = believed.tokens * believed.probability
        memo: _Memo = (parts, view)  # rendered once: its prepare takes them
        return Quote(name, view.total_tokens, cached, t.input_price, t.profile.read_mult, memo=memo)

    async def prepare(
        self, name: str, call: Call, quote: Quote[_Memo] | None = None
    ) -> ProviderPrepared:
        """Plan the cache and render once: the header and turns the log keeps, the
        provider-neutral call, the planner's breakpoints and directives.  Nothing waits
        and nothing is claimed (the fan-in hold is :meth:`acquire`)."""
        t0 = time.perf_counter()
        t = self.path.target(name)  # 404 / 503 before anything else
        req = call.chat
        memo = quote.memo if quote is not None else None
        parts, view = memo if memo is not None else (self._call(name, call), None)
        header, turns, chat, lint = parts
        tenant = call.who.tenant
        with call.trace.step("plan", target=name) as span, self._failures(t):
            planned = self.path.prepare(t, chat, tenant, call.warm, req, view, call.session)
            span.set_attribute("vcache.breakpoints", len(planned.marked))
        return ProviderPrepared(
            call, name, planned, header, turns, call.request_id, t0, tuple(lint)
        )

    async def acquire(self, p: ProviderPrepared) -> ProviderPrepared:
        """The send-one-then-fan hold (the ``fan_in`` step, where the control loop runs):
        ``p`` holding the :class:`~gateway.providers.control.Fan` when it is the first of
        a cold anchor's siblings (:meth:`release` gives it back)."""
        planned = p.planned
        if planned.anchor is None or planned.warm:
            return p
        with p.call.trace.step("fan_in", target=p.target) as span:
            held = await self.path.acquire(planned)
            span.set_attribute("vcache.fan_first", held.fan is not None)
        return dataclasses.replace(p, planned=held)

    def release(self, p: ProviderPrepared) -> None:
        """Let the siblings held for this call's anchor go (nothing if it held none)."""
        p.planned.release()

    async def send(self, p: ProviderPrepared, session: str | None) -> Pieces:
        """The provider's deltas as answer pieces; errors in the API's terms; the usage
        last.  Siblings held for this call's anchor go, whatever happens to it."""
        t, trace = p.planned.target, p.call.trace
        timing = _Timing(self.metrics, p.planned.call.model, p.target, p.t0)
        trace.begin("dispatch", target=p.target)
        first = True
        usage: ProviderUsage | None = None  # the provider's, with its last delta
        try:
            with self._failures(t):
                async with aclosing(self.path.send(p.planned)) as deltas:
                    async for d in deltas:
                        usage = d.usage or usage
                        if first:  # the first token
                            trace.finish("dispatch")
                            trace.begin("generate")
                            first = False
                        if d.text or d.tool_calls or d.thinking:
                            timing.output()
                        if d.text or d.finish_reason or d.tool_calls or d.thinking:
                            yield _piece(d)
                trace.finish("generate")
        finally:
            p.planned.release()
        # what planning decided and handed over (a Gemini cached content to create or
        # delete), now that the answer is in and before it ends
        await self.path.cached_contents.run(p.planned.actions)
        yield Piece(usage=usage_of(usage))

    def retry(self, p: ProviderPrepared, error: Exception) -> ProviderPrepared | None:
        """A cached-content handle the provider no longer knows (a false warm): the same
        call with the prompt inline, journaled as its own dispatch."""
        cause = error.__cause__ if isinstance(error, APIError) else error
        if not isinstance(cause, ProviderNotFound):
            return None
        inline = self.path.inline(p.planned)
        if inline is None:
            return None
        rid = f"{p.call.request_id}-1"
        return dataclasses.replace(p, planned=inline, request_id=rid)

    def settle(self, p: ProviderPrepared, usage: Usage) -> None:
        """Verify, then account: the usage the provider reported (as the answer's last
        piece carried it) into the belief."""
        self.path.settle(p.planned, p.call.request_id, reported(usage))
