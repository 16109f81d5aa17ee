"""Chat completions served by a hosted provider, as answer pieces.

Per request: split it into a header and turns (the session log's shapes,
:mod:`gateway.sessions.render`), open its place in the journal, let the
provider path plan and render it once, journal the exact bytes, send; a
cached-content handle the provider no longer knows (a false warm) is dropped
and the call sent again inline, journaled as its own dispatch.  The usage
telemetry is settled into the belief when the answer ends.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from contextlib import aclosing

from engines.errors import EngineError
from engines.providers.base import ChatCall, Delta, ProviderUsage
from engines.providers.errors import ProviderNotFound
from gateway.core.errors import InvalidRequest, from_engine_error
from gateway.core.metrics import Metrics
from gateway.core.outputs import Usage
from gateway.core.schemas import ChatCompletionRequest, tool_calls_json
from gateway.core.shaping import Piece, Pieces, Sample, ToolCallDelta
from gateway.core.tracing import RequestTrace, Tracing
from gateway.core.types import Served
from gateway.providers.path import Outcome, Prepared, ProviderPath
from gateway.service.journal import Journal
from gateway.sessions.log import Open
from gateway.sessions.render import (
    SystemLayouts,
    directives_of,
    provider_call,
    request_config,
    request_parts,
)
from manifest.sessionlog import Header


def usage_of(u: ProviderUsage | None) -> Usage:
    if u is None:
        return Usage.of(0, 0, 0)
    return Usage.of(u.prompt_tokens, u.completion_tokens, u.cached_tokens, u.cache_write_tokens)


def _local_only_parameters(req: ChatCompletionRequest) -> None:
    """What hosted-provider targets do not take yet (an alias falls back past them)."""
    asked = {
        "n": req.n > 1,
        "logprobs": bool(req.logprobs),
        "response_format": req.structured() is not None,
    }
    for param, on in asked.items():
        if on:
            raise InvalidRequest(
                f"{param} is served by the local model only, not by hosted-provider targets",
                param=param,
                code="unsupported_on_target",
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


class ProviderChat:
    def __init__(self, path: ProviderPath, layout: str, journal: Journal, metrics: Metrics) -> None:
        self.path = path
        self.metrics = metrics
        self.layout = layout
        self.journal = journal
        self.layouts = SystemLayouts()

    def _open(
        self,
        req: ChatCompletionRequest,
        target: str,
        served: Served,
        tenant: str,
        session: str | None,
    ) -> tuple[ChatCall, Open | None]:
        self.path.target(target)  # 404 / 503 before anything else
        _local_only_parameters(req)
        system, turns = request_parts(req)
        config = request_config(req, self.layout)
        header = Header.make(req.model, target, system, req.tool_dicts(), config)
        call, lint_names = provider_call(header, turns, self.layouts)
        served.target, served.dispatch, served.lint = target, None, tuple(lint_names)
        return call, self.journal.open(tenant, header, turns, session)

    async def _deltas(
        self,
        call: ChatCall,
        op: Open | None,
        served: Served | None,
        tenant: str,
        target: str,
        rid: str,
        out: Outcome,
        warm: bool = False,
        trace: RequestTrace | None = None,
        req: ChatCompletionRequest | None = None,
    ) -> AsyncGenerator[Delta, None]:
        """The provider's deltas: planned once, journaled before each send, errors in the
        API's terms."""
        t = self.path.target(target)
        trace = trace or Tracing().request("vcache.warm")  # warms are not traced
        p: Prepared | None = None
        try:
            with trace.step("plan", target=target) as span:
                p = await self.path.prepare(t, call, tenant, warm, req)
                span.set_attribute("vcache.breakpoints", len(p.marked))
            if served is not None:
                served.breakpoints = p.placed_by
            attempt, yielded = 0, False
            while True:
                request_id = rid if attempt == 0 else f"{rid}-{attempt}"
                body = p.rendered.body
                directives = directives_of(p.directives)
                with trace.step("journal"):
                    await self.journal.sent(
                        op, served, request_id, target, "provider", directives, body
                    )
                trace.begin("dispatch", target=target, attempt=attempt)
                try:
                    async with aclosing(self.path.send(p, out)) as deltas:
                        async for d in deltas:
                            if not yielded:  # the first token
                                trace.finish("dispatch")
                                trace.begin("generate")
                            yielded = True
                            yield d
                    trace.finish("generate")
                    break
                except ProviderNotFound:
                    inline = None if yielded or attempt else self.path.inline(p)
                    if inline is None:
                        raise
                    p, attempt = inline, attempt + 1
        except Exception as exc:
            self.path.failed(t)
            if isinstance(exc, EngineError):
                raise from_engine_error(exc) from exc
            raise
        finally:
            if p is not None:
                p.release()  # siblings held for this one go, whatever happened to it
        self.path.settle(p, rid, out)

    async def answer(
        self,
        req: ChatCompletionRequest,
        tenant: str,
        target: str,
        served: Served,
        rid: str,
        session: str | None,
        trace: RequestTrace,
    ) -> Pieces:
        t0 = time.perf_counter()
        call, op = self._open(req, target, served, tenant, session)
        out = Outcome()
        answer = Sample()
        timing = _Timing(self.metrics, call.model, target, t0)
        deltas = self._deltas(call, op, served, tenant, target, rid, out, trace=trace, req=req)
        async with aclosing(deltas):
            async for d in deltas:
                if d.text or d.tool_calls:
                    timing.output()
                if d.text or d.finish_reason or d.tool_calls:
                    parts = tuple(
                        ToolCallDelta(c.index, c.id, c.name, c.arguments) for c in d.tool_calls
                    )
                    piece = Piece(d.text, d.finish_reason, tool_calls=parts)
                    answer.add(piece)
                    yield piece
        usage = usage_of(out.usage)
        calls = answer.tool_calls()
        called = tool_calls_json([c.model_dump() for c in calls]) if calls else None
        await self.journal.answered(op, served, rid, "".join(answer.text), usage, called)
        yield Piece(usage=usage)

    async def warm(
        self, req: ChatCompletionRequest, tenant: str, target: str, rid: str
    ) -> ProviderUsage | None:
        """Prefill the planned breakpoints without generating (Anthropic ``max_tokens: 0``);
        on implicit providers the first real request warms, so this sends a one-token call.
        Journaled like any request that reaches a model."""
        req = req.model_copy(update={"max_tokens": 1, "stream": False})
        call, op = self._open(req, target, Served(), tenant, None)
        out = Outcome()
        warming = self._deltas(call, op, None, tenant, target, rid, out, True, req=req)
        async with aclosing(warming) as ds:
            async for _ in ds:
                pass
        await self.journal.answered(op, None, rid, "", usage_of(out.usage))
        return out.usage
