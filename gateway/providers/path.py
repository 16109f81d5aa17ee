"""The hosted-provider path: plan the cache, render, send, fold the telemetry.

For one chat call on one target (``anthropic/claude-sonnet-4-5``, ...):
render the prompt once plainly to name its segment boundaries
(:class:`~gateway.providers.book.PromptView`), ask the belief what is warm,
let ``manifest.planner`` place breakpoints (explicit) or keep the prefix
byte-stable with a ``prompt_cache_key`` (implicit), name a Gemini
cached-content handle where one lives (creating one once the anchor's reuse
passes the break-even, and deleting an expired one, are actions the send runs
after the answer: planning decides and hands over), send with retries, then
settle the usage telemetry (verify, then account).

:meth:`ProviderPath.prepare` decides and renders only.  What waits is
:meth:`ProviderPath.acquire`, after the journal: the send-one-then-fan hold
(:meth:`~gateway.providers.control.Control.fan_in`).  The first sibling of a
cold anchor gets a :class:`~gateway.providers.control.Fan`, the claim its
siblings wait on; :meth:`PlannedCall.release` gives it back (at the answer's
first delta, or on any path where the answer never comes).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from engines.providers.base import (
    CacheDirectives,
    ChatCall,
    Delta,
    ProviderUsage,
    Rendered,
    ToolCallPart,
)
from engines.providers.client import ProviderClient
from engines.providers.transport import Transport
from gateway.core.config import Settings
from gateway.core.metrics import Metrics
from gateway.core.schemas import ChatCompletionRequest
from gateway.providers.book import Believed, PromptView, ProviderCacheBook, Settlement
from gateway.providers.control import Anchor, Control, Fan
from gateway.providers.gemini import CacheAction, CachedContents, Handle
from gateway.providers.targets import ProviderTarget, ProviderTargets
from gateway.providers.tips import Tip
from manifest.planner import TargetState, WarmPrimitive, client_breakpoints, plan
from manifest.session_tips import TipPlan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlannedCall:
    """A call planned and rendered for one target: what is sent (and journaled first)."""

    target: ProviderTarget
    call: ChatCall
    view: PromptView
    believed: Believed
    marked: tuple[str, ...]  # the segment keys that carry a breakpoint
    handle: Handle | None
    directives: CacheDirectives
    rendered: Rendered
    anchor: Anchor | None = None  # the prompt's anchor, where the control loop runs
    warm: bool = False  # prefill only: no arrival, no fan-in hold
    fan: Fan | None = None  # acquired: the first of a cold anchor's siblings releases the rest
    tip: Tip | None = None  # an agent session's turn: its conversation across the pause
    actions: tuple[CacheAction, ...] = ()  # run by send after the answer (Gemini caches)
    # whose breakpoints these are when the client placed its own: "client" (taken as
    # sent) or "planner" (invalid for the target: at most 4, none below the minimum)
    placed_by: str | None = None

    def release(self) -> None:
        """Let the anchor's held siblings go (the provider has written it, or never will
        for this call); idempotent."""
        if self.fan is not None:
            self.fan.release()


def _segment(view: PromptView, segment: str) -> str:
    """A client breakpoint's segment as a boundary key of the rendered prompt: a mark on
    the system prompt closes all of it (its volatile part, under the canonical layout)."""
    if segment == "system" and "system:volatile" in view.keys:
        return "system:volatile"
    return segment


class ProviderPath:
    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
        client_factory: Callable[..., ProviderClient] = ProviderClient,
        transport: Transport | None = None,
        book: ProviderCacheBook | None = None,
        control: Control | None = None,
    ) -> None:
        """``book``: the belief and ledger (one of its own, publishing to no one, if not
        given); ``control``: the control loop, when one runs."""
        self.targets = ProviderTargets(settings, client_factory, transport)
        self._metrics = metrics
        self._clock = clock
        self.book = book or ProviderCacheBook(clock)
        self.control = control
        gemini = settings.providers.get("gemini")
        ttl = gemini.cached_content_ttl_s if gemini is not None else 3600
        self.cached_contents = CachedContents(clock, ttl)

    def target(self, name: str) -> ProviderTarget:
        """``provider/model`` for a configured provider (404 / 503 otherwise)."""
        return self.targets.target(name)

    def view(self, t: ProviderTarget, call: ChatCall, tenant: str) -> PromptView:
        """The prompt rendered plainly (no cache directives): its boundaries' bytes,
        token estimates and digests."""
        plain = t.client.adapter.render(call, CacheDirectives())
        return PromptView.of(
            t.name,
            tenant,
            plain.prompt,
            dict(plain.segment_ends),
            call.segment_keys(),
            plain.media,
        )

    @staticmethod
    def _cache_key(view: PromptView) -> str | None:
        """OpenAI's ``prompt_cache_key``: the anchor (first boundary) digest, so requests
        sharing the anchor reach the same cache shard."""
        return f"vcache-{view.digests[0][:24]}" if view.digests else None

    def prepare(
        self,
        t: ProviderTarget,
        call: ChatCall,
        tenant: str,
        warm: bool = False,
        req: ChatCompletionRequest | None = None,
        view: PromptView | None = None,
        session: str | None = None,
    ) -> PlannedCall:
        """Plan the cache for ``call`` and render it, once, before anything is sent; it
        waits for nothing and claims nothing (the fan-in hold is :meth:`acquire`).
        ``warm``: prefill only, where the provider has a primitive for it.  With the
        control loop on, the request counts as an arrival on its anchor (``req`` is what
        a heartbeat of a new anchor will send).  ``view``: the prompt's plain view, where
        the call was quoted on it.  ``session``: a named agent session, whose turn plans
        its tip for the pause after it."""
        view = view or self.view(t, call, tenant)  # given: rendered to quote
        c, anchor, tip = self.control, None, None
        if c is not None and c.enabled:
            anchor = c.observe(t, tenant, view, req, arrival=not warm)
            if session is not None and req is not None and not warm:
                tip = c.session_turn(t, tenant, session, req, view)
        believed = self.book.believed(view)
        state = TargetState(
            believed_warm_tokens=believed.tokens, warm_probability=believed.probability
        )
        layout = view.layout()
        p = plan(layout, t.profile, state)
        breakpoints = p.breakpoints
        long_ttl: tuple[str, ...] = ()
        if c is not None and c.long_ttl(anchor):  # the anchor, and marks before it: 1h first
            long_ttl = tuple(view.keys[i] for i in p.breakpoints if i <= view.anchor())
        if tip is not None and tip.plan is TipPlan.LONG:  # the whole conversation, 1h
            long_ttl = tuple(view.keys[i] for i in p.breakpoints)
        asked = req.hints.breakpoints if req is not None and not t.spec.cached_contents else ()
        placed_by = None
        if asked:  # the client's own cache_control marks, taken as sent when valid
            keys = [_segment(view, b.segment) for b in asked]
            taken = client_breakpoints(layout, t.profile, keys)
            placed_by = "client" if taken is not None else "planner"
            if taken is not None:
                breakpoints = taken
                long_ttl = tuple(k for k, b in zip(keys, asked, strict=True) if b.ttl_s > 300)
        marked = tuple(view.keys[i] for i in breakpoints)
        handle: Handle | None = None
        actions: tuple[CacheAction, ...] = ()
        if t.spec.cached_contents:  # decided here, run by send once the answer is in
            handle, actions = self.cached_contents.use(t.name, t.client, t.profile, call, view)
        directives = CacheDirectives(
            breakpoints=marked,
            ttl_s=t.config.cache_ttl_s,
            cache_key=self._cache_key(view) if t.spec.cache_key else None,
            cached_content=handle.name if handle else None,
            warm=warm and t.profile.warm is WarmPrimitive.MAX_TOKENS_0,
            long_ttl=long_ttl,
            retention=t.config.prompt_cache_retention if t.spec.cache_key else None,
        )
        rendered = t.client.adapter.render(call, directives)
        return PlannedCall(
            t,
            call,
            view,
            believed,
            marked,
            handle,
            directives,
            rendered,
            anchor,
            warm,
            None,
            tip,
            actions,
            placed_by,
        )

    async def acquire(self, p: PlannedCall) -> PlannedCall:
        """The send-one-then-fan hold, after the journal: a sibling of a cold anchor whose
        first is on its way waits (at most ``fan_wait_s``) for its answer to begin; the
        first gets the :class:`Fan` (``p`` with it: :meth:`PlannedCall.release` gives it
        back).  Nothing for a warm, or without the control loop."""
        c = self.control
        if c is None or not c.enabled or p.warm or p.anchor is None or p.fan is not None:
            return p
        fan = await c.fan_in(p.anchor, self.book.believed(p.view).index, p.view.anchor())
        return p if fan is None else dataclasses.replace(p, fan=fan)

    def inline(self, p: PlannedCall) -> PlannedCall | None:
        """After :class:`ProviderNotFound` on a request that used a cached-content handle:
        the handle expired or was deleted on the provider's side (a false warm); the same
        call with the prompt inline.  None when there was no handle to blame."""
        if p.handle is None:
            return None
        self.cached_contents.lost(p.target.name, p.handle)
        self.book.count_false_warm(p.target.name)
        self._metrics.provider_false_warm.labels(p.target.name).inc()
        directives = dataclasses.replace(p.directives, cached_content=None)
        rendered = p.target.client.adapter.render(p.call, directives)
        return dataclasses.replace(p, handle=None, directives=directives, rendered=rendered)

    async def send(self, p: PlannedCall) -> AsyncGenerator[Delta, None]:
        """One attempt at the provider (its client retries transient failures): its
        deltas, the last with the usage the provider reported (what :meth:`settle`
        folds)."""
        async with aclosing(self._send(p.target, p.rendered)) as deltas:
            async for d in deltas:
                p.release()  # the answer began: the provider has written the prefix
                yield d

    def failed(self, t: ProviderTarget) -> None:
        """A call that did not complete (its error is the caller's to raise)."""
        self._metrics.provider_requests.labels(t.name, "error").inc()

    def settle(self, p: PlannedCall, request_id: str, u: ProviderUsage | None) -> Settlement | None:
        """Verify, then account: fold the usage the provider reported (``u``; None: it
        reported none, nothing is folded) into the belief; what was settled."""
        t, m = p.target, self._metrics
        m.provider_requests.labels(t.name, "ok").inc()
        if p.tip is not None and self.control is not None:
            self.control.tips.end(p.tip)  # the session's pause begins
        if u is None:
            return None
        s = self.book.settle(
            request_id,
            p.view,
            t.profile,
            t.prices,
            p.believed,
            p.marked,
            u,
            t.ttl_s,
            p.directives.long_ttl,
            t.long_ttl_s,
        )
        m.provider_tokens.labels(t.name, "prompt").inc(u.prompt_tokens)
        m.provider_tokens.labels(t.name, "cached").inc(u.cached_tokens)
        m.provider_tokens.labels(t.name, "written").inc(u.cache_write_tokens)
        m.provider_tokens.labels(t.name, "credited").inc(s.credited_tokens)
        if s.false_warm:
            m.provider_false_warm.labels(t.name).inc()
            log.warning(
                "%s: false warm (believed %d tokens warm, read %d; first differing byte %s, in %s)",
                t.name,
                s.believed_warm_tokens,
                u.cached_tokens,
                s.broken_at,
                s.broken_part,
            )
        return s

    async def _send(self, t: ProviderTarget, r: Rendered) -> AsyncGenerator[Delta, None]:
        if r.stream:
            async with aclosing(t.client.stream(r)) as deltas:
                async for d in deltas:
                    yield d
            return
        answer = await t.client.complete(r)
        if answer.thinking:
            yield Delta(thinking=answer.thinking)
        if answer.text or answer.tool_calls:
            parts = tuple(
                ToolCallPart(i, c.id, c.name, c.arguments) for i, c in enumerate(answer.tool_calls)
            )
            yield Delta(text=answer.text, tool_calls=parts)
        yield Delta(
            usage=answer.usage,
            finish_reason=answer.finish_reason,
            stop_sequence=answer.stop_sequence,
        )

    def stats(self) -> dict[str, Any]:
        snap = self.book.snapshot()
        for name, t in self.targets.known().items():
            snap.setdefault(name, {})["retries"] = t.client.retries
        if self.cached_contents.created:
            snap["gemini_cached_contents"] = self.cached_contents.snapshot()
        return snap

    async def close(self) -> None:
        known = self.targets.known().values()
        await self.cached_contents.delete_all({t.name: t.client for t in known})
        await self.targets.close()
