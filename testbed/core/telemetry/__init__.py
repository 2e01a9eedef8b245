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
from contextlib import ContextDecorator, contextmanager
from contextvars import ContextVar
from typing import Any, TypedDict, Unpack

from opentelemetry import context as context_api
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import (
    INVALID_SPAN,
    Link,
    NonRecordingSpan,
    NoOpTracerProvider,
    ProxyTracerProvider,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

__all__ = [
    "INVALID_SPAN",
    "Span",
    "SpanKind",
    "SpanOptions",
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


class SpanOptions(TypedDict, total=False):
    """How a span of :func:`traced` or :func:`start_span` starts; every key may be left out."""

    kind: SpanKind
    """``SpanKind.INTERNAL`` when left out."""
    parent: str
    """A W3C ``traceparent`` to parent the span on (a server span's client); empty or left
    out: the span is a child of the current span."""
    tracestate: str
    """The W3C ``tracestate`` that came with ``parent``."""
    links: Sequence[str]
    """``traceparent`` strings of the operations a batched span serves."""
    attributes: Mapping[str, Any] | None


def traced(name: str, **options: Unpack[SpanOptions]) -> _Traced:
    """A span around the block (``with traced(...) as span``); with tracing off, a no-op span.

    ``options``: :class:`SpanOptions` (kind, parent, tracestate, links, attributes).
    Exceptions mark the span as an error and propagate. Also usable as a decorator
    (``@traced("name")``).
    """
    return _Traced(name, options)


class _Traced(ContextDecorator):
    """What ``start_as_current_span`` does (start, make current, record an exception, end),
    as one plain context manager: a span is started and ended once per cache operation, and
    the SDK's three nested generator-based managers cost more than the span itself."""

    __slots__ = ("_name", "_options", "_span", "_token")

    def __init__(self, name: str, options: SpanOptions) -> None:
        self._name = name
        self._options = options
        self._span: Span | None = None
        self._token: object = None

    def _recreate_cm(self) -> _Traced:
        return _Traced(self._name, self._options)  # a decorated function's every call: a span

    def __enter__(self) -> Span:
        if not enabled():
            return INVALID_SPAN
        span = start_span(self._name, **self._options)
        self._span = span
        self._token = context_api.attach(trace.set_span_in_context(span))
        return span

    def __exit__(self, exc_type: object, exc: BaseException | None, traceback: object) -> None:
        span, self._span = self._span, None
        if span is None:
            return
        context_api.detach(self._token)  # type: ignore[arg-type]
        # As the SDK's use_span: Exception subclasses only (not GeneratorExit and the like).
        if isinstance(exc, Exception) and span.is_recording():
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        span.end()


def start_span(
    name: str, *, start_time_ns: int | None = None, **options: Unpack[SpanOptions]
) -> Span:
    """A span the caller ends itself (``span.end()``), for operations that outlive a call,
    such as a lookup answered several scheduler steps later. Not made current."""
    if not enabled():
        return INVALID_SPAN
    parent = options.get("parent", "")
    links = options.get("links", ())
    return _get_tracer().start_span(
        name,
        context=_extract(parent, options.get("tracestate", "")) if parent else None,
        kind=options.get("kind", SpanKind.INTERNAL),
        links=links_from(links) if links else None,
        attributes=options.get("attributes"),
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
    span_context = trace.get_current_span().get_span_context()
    if not span_context.is_valid:
        return "", ""
    return (
        f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}-"
        f"{span_context.trace_flags:02x}",
        span_context.trace_state.to_header() if span_context.trace_state else "",
    )


def links_from(traceparents: Sequence[str]) -> list[Link]:
    """Links to the spans named by ``traceparents``; malformed or empty ones are skipped."""
    links = []
    for traceparent in traceparents:
        span_context = _span_context(traceparent) if traceparent else None
        if span_context is not None:
            links.append(Link(span_context))
    return links


def _span_context(traceparent: str) -> SpanContext | None:
    """The remote span a W3C ``traceparent`` names, read in place (``None``: malformed),
    as the W3C propagator reads it."""
    shaped = len(traceparent) == 55 and traceparent[2] == traceparent[35] == traceparent[52] == "-"
    if not shaped or not traceparent.startswith("00-"):
        return _propagated(traceparent, "")  # another version, or malformed: the W3C rules
    _, trace_hex, span_hex, flags_hex = traceparent.split("-")
    try:
        trace_id, span_id, flags = int(trace_hex, 16), int(span_hex, 16), int(flags_hex, 16)
    except ValueError:
        return None
    if not trace_id or not span_id or not _LOWER_HEX.issuperset(traceparent):
        return None
    return SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(flags))


def _propagated(traceparent: str, tracestate: str) -> SpanContext | None:
    carrier = {"traceparent": traceparent}
    if tracestate:
        carrier["tracestate"] = tracestate
    span_context = trace.get_current_span(_propagator.extract(carrier)).get_span_context()
    return span_context if span_context.is_valid else None


_EXTRACTED: dict[tuple[str, str], Any] = {}
"""The contexts of the parents seen last (a request's span is the parent of each of its
operations' spans): contexts are immutable, so one is shared by every child."""
_EXTRACTED_MAX = 4096


def _extract(traceparent: str, tracestate: str) -> Any:
    """A context whose current span is the remote one ``traceparent`` names (an empty
    context, as the propagator gives, when it is malformed)."""
    key = (traceparent, tracestate)
    context = _EXTRACTED.get(key)
    if context is not None:
        return context
    span_context = (
        _propagated(traceparent, tracestate) if tracestate else _span_context(traceparent)
    )
    if span_context is None:
        context = Context()
    else:
        context = trace.set_span_in_context(NonRecordingSpan(span_context), Context())
    if len(_EXTRACTED) >= _EXTRACTED_MAX:
        _EXTRACTED.clear()
    _EXTRACTED[key] = context
    return context


_LOWER_HEX = frozenset("0123456789abcdef-")
