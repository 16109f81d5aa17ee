"""OpenTelemetry spans of the request path, exported over OTLP/HTTP.

Off by default (no endpoint: a no-op tracer, nothing is recorded).  With
``otlp_endpoint`` set, each request is one ``vcache.chat`` (or
``vcache.completion``) span with a child per step: ``tokenize`` or ``plan``
(a local prompt's template and tokens; a provider's breakpoints and render),
``journal``, the target's acquire (``route`` on the local replicas: the index
sync, the choice, a prefill joined, with the replica and the predicted cached
tokens; ``fan_in`` on a provider whose control loop runs: the
send-one-then-fan hold, ``vcache.fan_first`` when this request writes the
anchor), ``dispatch`` (from the send to the first token; on a local replica,
its TTFT by phase, ``vcache.ttft.<phase>_s``, as ``gateway/local/ttft.py``
splits it) and ``generate`` (to the last).  Spans
are parented explicitly, not through the current context, so they survive the
hops a streamed answer makes between tasks.  The provider is the app's own,
never the process-global one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter


class Tracing:
    def __init__(
        self,
        endpoint: str | None = None,
        service_name: str = "vcache",
        processor: SpanProcessor | None = None,
    ) -> None:
        self._provider: TracerProvider | None = None
        if endpoint is not None or processor is not None:
            self._provider = TracerProvider(resource=Resource({"service.name": service_name}))
            if processor is None:
                processor = BatchSpanProcessor(_otlp(endpoint or ""))
            self._provider.add_span_processor(processor)
            self._tracer: trace.Tracer = self._provider.get_tracer("vcache")
        else:
            self._tracer = trace.NoOpTracer()

    @property
    def enabled(self) -> bool:
        return self._provider is not None

    def request(self, name: str, **attrs: Any) -> RequestTrace:
        return RequestTrace(self._tracer, self._tracer.start_span(name, attributes=_clean(attrs)))

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()


class RequestTrace:
    """One request's span and its steps."""

    def __init__(self, tracer: trace.Tracer, span: trace.Span) -> None:
        self._tracer = tracer
        self.span = span
        # Tracing off (or this request not sampled): its steps would record nothing either.
        self._recording = span.is_recording()
        self._open: dict[str, trace.Span] = {}

    def _child(self, name: str, attrs: dict[str, Any]) -> trace.Span:
        if not self._recording:
            return trace.INVALID_SPAN
        ctx = trace.set_span_in_context(self.span)
        return self._tracer.start_span(name, context=ctx, attributes=_clean(attrs))

    @contextlib.contextmanager
    def step(self, name: str, **attrs: Any) -> Iterator[trace.Span]:
        span = self._child(name, attrs)
        try:
            yield span
        except BaseException as exc:
            span.record_exception(exc)
            span.set_status(trace.StatusCode.ERROR)
            raise
        finally:
            span.end()

    def begin(self, name: str, **attrs: Any) -> None:
        """A step that ends later, with :meth:`finish` (``dispatch``, ``generate``)."""
        self._open[name] = self._child(name, attrs)

    def finish(self, name: str, **attrs: Any) -> None:
        span = self._open.pop(name, None)
        if span is not None:
            if self._recording:
                span.set_attributes(_clean(attrs))
            span.end()

    def end(self, error: BaseException | None = None, **attrs: Any) -> None:
        for name in list(self._open):
            self.finish(name)
        if self._recording:
            self.span.set_attributes(_clean(attrs))
        if error is not None:
            self.span.record_exception(error)
            self.span.set_status(trace.StatusCode.ERROR)
        self.span.end()


def _clean(attrs: dict[str, Any]) -> dict[str, Any]:
    return {f"vcache.{k}": v for k, v in attrs.items() if isinstance(v, str | int | float | bool)}


def _otlp(endpoint: str) -> SpanExporter:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=endpoint)
