"""Tracing for library code: the one ``traced`` helper, W3C context in messages, attributes.

Library code (connector, server, engines) calls only the OpenTelemetry *API* through this
module; entry points install the SDK with :mod:`testbed.core.telemetry.setup`. Until they do,
:func:`traced` yields a shared non-recording span without touching the context, so tracing
off costs about a microsecond per operation and the code paths are the same.

Trace context crosses the ZeroMQ boundary inside each request message as the W3C
``traceparent`` / ``tracestate`` strings: :func:`inject` fills them from the current span,
and ``traced(..., parent=traceparent)`` makes the server span its child.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import (
    INVALID_SPAN,
    Link,
    NoOpTracerProvider,
    ProxyTracerProvider,
    Span,
    SpanKind,
    StatusCode,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

__all__ = [
    "INVALID_SPAN",
    "Span",
    "SpanKind",
    "enabled",
    "fail",
    "inject",
    "installed",
    "instance_scope",
    "links_from",
    "span_id_of",
    "start_span",
    "traceparent_of",
    "traced",
    "use_provider",
]

_TRACER_NAME = "kvtestbed"
current_instance: ContextVar[int | None] = ContextVar("kvtb_instance", default=None)
"""The fleet instance whose work runs now (:func:`instance_scope`); ``None`` outside fleets."""
_propagator = TraceContextTextMapPropagator()
_provider: trace.TracerProvider | None = None
_tracer: trace.Tracer | None = None


def use_provider(provider: trace.TracerProvider | None) -> None:
    """Routes this module's spans to ``provider`` (entry points, via ``telemetry.setup``);
    ``None`` falls back to the global provider (an application's own OpenTelemetry set-up)."""
    global _provider, _tracer
    _provider = provider
    _tracer = provider.get_tracer(_TRACER_NAME) if provider is not None else None


def installed() -> bool:
    """Whether an entry point of this process installed the SDK here (``use_provider``)."""
    return _tracer is not None


def enabled() -> bool:
    """Whether spans are recorded: a provider was installed here or globally."""
    if _tracer is not None:
        return True
    return not isinstance(trace.get_tracer_provider(), ProxyTracerProvider | NoOpTracerProvider)


def _get_tracer() -> trace.Tracer:
    return _tracer if _tracer is not None else trace.get_tracer(_TRACER_NAME)


@contextmanager
def traced(
    name: str,
    *,
    kind: SpanKind = SpanKind.INTERNAL,
    parent: str = "",
    tracestate: str = "",
    links: Sequence[str] = (),
    attributes: Mapping[str, Any] | None = None,
) -> Iterator[Span]:
    """A span around the block; with tracing off, a no-op span.

    ``parent``: a W3C ``traceparent`` to parent the span on (a server span's client); when
    empty the span is a child of the current span. ``links``: ``traceparent`` strings of the
    operations a batched span serves. Exceptions mark the span as an error and propagate.
    Also usable as a decorator (``@traced("name")``).
    """
    if not enabled():
        yield INVALID_SPAN
        return
    context = _extract(parent, tracestate) if parent else None
    with _get_tracer().start_as_current_span(
        name,
        context=context,
        kind=kind,
        links=links_from(links),
        attributes=attributes,
    ) as span:
        yield span


def start_span(
    name: str,
    *,
    kind: SpanKind = SpanKind.INTERNAL,
    parent: str = "",
    tracestate: str = "",
    links: Sequence[str] = (),
    attributes: Mapping[str, Any] | None = None,
    start_time_ns: int | None = None,
) -> Span:
    """A span the caller ends itself (``span.end()``), for operations that outlive a call,
    such as a lookup answered several scheduler steps later. Not made current."""
    if not enabled():
        return INVALID_SPAN
    return _get_tracer().start_span(
        name,
        context=_extract(parent, tracestate) if parent else None,
        kind=kind,
        links=links_from(links),
        attributes=attributes,
        start_time=start_time_ns,
    )


@contextmanager
def instance_scope(instance: int) -> Iterator[None]:
    """Spans started inside belong to fleet instance ``instance``: the SDK that
    :mod:`testbed.core.telemetry.setup` installs stamps them with ``kvcache.instance``. A fleet runs
    its instances in one process, and their connectors trace through this one module."""
    token = current_instance.set(instance)
    try:
        yield
    finally:
        current_instance.reset(token)


def traceparent_of(span: Span) -> str:
    """The W3C ``traceparent`` naming ``span`` (empty for a non-recording span)."""
    span_context = span.get_span_context()
    if not span_context.is_valid:
        return ""
    ids = f"{span_context.trace_id:032x}-{span_context.span_id:016x}"
    return f"00-{ids}-{span_context.trace_flags:02x}"


def span_id_of(span: Span) -> str:
    """The 16-hex-digit id of ``span`` (empty for a non-recording span)."""
    span_context = span.get_span_context()
    return f"{span_context.span_id:016x}" if span_context.is_valid else ""


def fail(span: Span, message: str) -> None:
    """Marks ``span`` as failed with a human-readable reason (also when no exception)."""
    span.set_status(StatusCode.ERROR, message)


def inject() -> tuple[str, str]:
    """``(traceparent, tracestate)`` of the current span, or empty strings when none."""
    if not enabled():
        return "", ""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return carrier.get("traceparent", ""), carrier.get("tracestate", "")


def links_from(traceparents: Sequence[str]) -> list[Link]:
    """Links to the spans named by ``traceparents``; malformed or empty ones are skipped."""
    links = []
    for traceparent in traceparents:
        if not traceparent:
            continue
        span_context = trace.get_current_span(_extract(traceparent, "")).get_span_context()
        if span_context.is_valid:
            links.append(Link(span_context))
    return links


def _extract(traceparent: str, tracestate: str) -> Any:
    carrier = {"traceparent": traceparent}
    if tracestate:
        carrier["tracestate"] = tracestate
    return _propagator.extract(carrier)
