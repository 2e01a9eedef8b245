"""The span recorder: a tracer provider behind the OpenTelemetry API that records each finished
operation as a row in columns and builds the SDK's spans only when it exports (any process).

An SDK span costs tens of microseconds on the request path (bounded attribute maps, locks, a
processor chain); a cache operation needs only its timestamps, ids, attributes and status kept
until an exporter wants them. :class:`RecorderProvider` is an API ``TracerProvider``: its
tracer starts a :class:`RowSpan` (ids from the process's generator, the sampler's decision, the
parent from the context, as the SDK's tracer does), whose ``end`` appends the span's fields to
one list per column. An export thread (every :data:`EXPORT_DELAY_S`, or as soon as a batch is
full) takes the columns, cleans each row's attributes with the SDK's rules
(``BoundedAttributes`` under the SDK's span limits, an overwritten key moved last, as the SDK
moves it) and hands the batches to the same exporters the SDK path feeds: the span file and its
columnar copy, OTLP, Jaeger. An exporter that writes rows itself (``writes_rows``: the span
file) takes them as a :class:`~testbed.core.telemetry.row_span.RowBatch`; for the others a
``ReadableSpan`` is built per row. What reaches them is span for span what the SDK would have
built.

Nothing is dropped silently: :attr:`RecorderProvider.ended` counts every span that ended, rows
beyond :data:`MAX_PENDING` that the exporters have not taken yet are refused and counted
(:attr:`RecorderProvider.refused`), and the caller's counts (``ended`` minus what each exporter
delivered) report both. ``synchronous`` exporters (a vLLM process's span file, which may be
stopped without a shutdown) get each span as it ends, in the caller's thread.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, sampling
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import Sampler
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, TraceFlags

from testbed.core.telemetry.row_span import (
    Row,
    RowBatch,
    RowSpan,
    SpanColumns,
    kept_as_is,
)

EXPORT_DELAY_S = 0.5
"""Longest a finished span waits for the export thread (``OTEL_BSP_SCHEDULE_DELAY``, in ms,
where set: the batch processor's variables apply to the recorder alike)."""
EXPORT_BATCH = 4096
"""Spans per export call (``OTEL_BSP_MAX_EXPORT_BATCH_SIZE``)."""
MAX_PENDING = 1 << 18
"""Finished spans kept for the exporters at most; beyond, a span is refused and counted
(``OTEL_BSP_MAX_QUEUE_SIZE``)."""

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_NOT_SAMPLED = TraceFlags(TraceFlags.DEFAULT)
_PARENT_BASED_ON = sampling.ParentBased(sampling.ALWAYS_ON).get_description()
"""The default sampler's description: a span is kept when it has no parent or a kept one."""


def _setting(variable: str, default: int) -> int:
    """An ``OTEL_BSP_*`` variable where set (the batch processor's), else ``default``."""
    value = os.environ.get(variable, "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else default


def _sampled(
    sampler: Sampler,
    context: Context | None,
    trace_id: int,
    span_id: int,
    name: str,
    kind: SpanKind,
    attributes: Mapping[str, Any] | None,
    links: Sequence[Link],
) -> tuple[SpanContext, dict[str, Any] | None]:
    """A new span's context as ``sampler`` decides it, and its attributes (``None``: not
    recorded), as the SDK's tracer asks its sampler."""
    result = sampler.should_sample(context, trace_id, name, kind, attributes, links)
    span_context = SpanContext(
        trace_id,
        span_id,
        is_remote=False,
        trace_flags=_SAMPLED if result.decision.is_sampled() else _NOT_SAMPLED,
        trace_state=result.trace_state,
    )
    if not result.decision.is_recording():
        return span_context, None
    return span_context, dict(result.attributes) if result.attributes else {}


class RecorderTracer(trace.Tracer):
    """Starts :class:`RowSpan` s as the SDK's tracer starts its spans."""

    def __init__(self, provider: RecorderProvider) -> None:
        self._provider = provider

    def start_span(
        self,
        name: str,
        context: Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Mapping[str, Any] | None = None,
        links: Sequence[Link] | None = (),
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
    ) -> trace.Span:
        provider = self._provider
        links = links or ()
        parent: SpanContext | None = trace.get_current_span(context).get_span_context()
        if parent is None or not parent.is_valid:
            parent = None
            trace_id = provider.id_generator.generate_trace_id()
        else:
            trace_id = parent.trace_id
        span_id = provider.id_generator.generate_span_id()
        if provider.follows_parent:  # the default sampler's decision, without its calls
            sampled = parent is None or parent.trace_flags.sampled
            span_context = SpanContext(
                trace_id,
                span_id,
                is_remote=False,
                trace_flags=_SAMPLED if sampled else _NOT_SAMPLED,
                trace_state=parent.trace_state if parent is not None else None,
            )
            recorded = dict(attributes) if attributes and sampled else None
        else:
            span_context, recorded = _sampled(
                provider.sampler, context, trace_id, span_id, name, kind, attributes, links
            )
            sampled = recorded is not None
        if not sampled:
            return NonRecordingSpan(span_context)
        recorded = recorded or {}
        stamp = provider.on_start
        if stamp is not None:
            stamp(recorded)
        return RowSpan(
            provider,
            name,
            span_context,
            parent,
            kind,
            recorded,
            tuple(links),
            time.time_ns() if start_time is None else start_time,
        )

    def start_as_current_span(self, *args: Any, **kwargs: Any) -> Any:
        return trace.use_span(self.start_span(*args, **kwargs), end_on_exit=True)


class RecorderProvider(trace.TracerProvider):
    """The tracer provider of a process whose spans are recorded as rows (see the module).

    ``exporters``: exported in batches by the export thread; ``synchronous``: exported span by
    span as each ends. ``on_start`` may add attributes to a span as it starts (the fleet
    instance stamp)."""

    def __init__(
        self,
        *,
        resource: Resource,
        sampler: Sampler | None,
        id_generator: IdGenerator,
        exporters: Sequence[SpanExporter] = (),
        synchronous: Sequence[SpanExporter] = (),
        on_start: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.resource = resource
        self.sampler = sampler if sampler is not None else sampling._get_from_env_or_default()
        self.follows_parent = self.sampler.get_description() == _PARENT_BASED_ON
        """Whether the sampler is the SDK's default (``parentbased_always_on``), whose decision
        and attributes :class:`RecorderTracer` then makes itself."""
        self.id_generator = id_generator
        self.limits = SpanLimits()
        self.on_start = on_start
        self.max_pending = _setting("OTEL_BSP_MAX_QUEUE_SIZE", MAX_PENDING)
        self.batch_size = _setting("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", EXPORT_BATCH)
        self.delay_s = _setting("OTEL_BSP_SCHEDULE_DELAY", int(EXPORT_DELAY_S * 1000)) / 1000
        self.ended = 0
        self.refused = 0
        """Spans that ended while :data:`MAX_PENDING` others waited for the exporters."""
        self._scope = InstrumentationScope("kvtestbed", "", None, None)
        self._exporters = tuple(exporters)
        self._synchronous = tuple(synchronous)
        self._columns = SpanColumns()
        self._lock = threading.Lock()
        self._export_lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._thread: threading.Thread | None = None
        if self._exporters:
            self._thread = threading.Thread(
                target=self._export_loop, name="kvtb-spans", daemon=True
            )
            self._thread.start()

    def get_tracer(self, *args: Any, **kwargs: Any) -> trace.Tracer:
        return RecorderTracer(self)

    def record(self, span: RowSpan, end_ns: int) -> None:
        """Appends a finished span to the columns (:meth:`RowSpan.end`)."""
        with self._lock:
            self.ended += 1
            if not span._context.trace_flags.sampled:
                return  # recorded but not sampled: never exported, as the batch processor does
            if self._synchronous:
                self._export_now(span, end_ns)
            if not self._exporters:
                return
            columns = self._columns
            if columns.count >= self.max_pending:
                self.refused += 1
                return
            columns.count += 1
            columns.name.append(span._name)
            columns.context.append(span._context)
            columns.parent.append(span._parent)
            columns.kind.append(span._kind)
            columns.start.append(span._start)
            columns.end.append(end_ns)
            columns.attributes.append(span._attributes)
            columns.events.append(span._events)
            columns.links.append(span._links)
            columns.status.append(span._status)
            if columns.count >= self.batch_size:
                self._wake.notify()

    def _export_now(self, span: RowSpan, end_ns: int) -> None:
        attributes = self._cleaned(span._attributes)
        row = (span._name, span._context, span._parent, span._kind, span._start, end_ns,
               attributes, span._events, span._links, span._status)  # fmt: skip
        self._hand(self._synchronous, [row])

    def _rows(self, columns: SpanColumns) -> list[Row]:
        """The rows of ``columns``, attributes cleaned and bounded as the SDK does."""
        cleaned = self._cleaned
        return [
            (name, context, parent, kind, start, end, cleaned(attributes), events, links, status)
            for name, context, parent, kind, start, end, attributes, events, links, status in (
                columns.rows()
            )
        ]

    def _readable(self, row: Row) -> ReadableSpan:
        name, context, parent, kind, start, end, attributes, events, links, status = row
        return ReadableSpan(
            name=name,
            context=context,
            parent=parent,
            resource=self.resource,
            attributes=attributes,
            events=tuple(events or ()),
            links=links,
            kind=kind,
            status=status,
            start_time=start,
            end_time=end,
            instrumentation_scope=self._scope,
        )

    def _cleaned(self, attributes: dict[str, Any]) -> Mapping[str, Any]:
        """``attributes`` as the SDK's bounded map keeps them (a plain ``dict`` where the map
        would hold the same: :func:`~testbed.core.telemetry.row_span.kept_as_is`)."""
        limits = self.limits
        kept = kept_as_is(attributes, limits.max_span_attributes, limits.max_attribute_length)
        if kept is not None:
            return kept
        return BoundedAttributes(
            limits.max_span_attributes,
            attributes,
            immutable=True,
            max_value_len=limits.max_attribute_length,
        )

    def _take(self) -> SpanColumns:
        columns, self._columns = self._columns, SpanColumns()
        return columns

    def _export_loop(self) -> None:
        while True:
            with self._lock:
                if not self._closed and self._columns.count < self.batch_size:
                    self._wake.wait(self.delay_s)
                closed = self._closed
                columns = self._take()
            self._export(columns)
            if closed:
                return

    def _export(self, columns: SpanColumns) -> None:
        if not columns.count:
            return
        with self._export_lock:
            self._hand(self._exporters, self._rows(columns))

    def _hand(self, exporters: Sequence[SpanExporter], rows: list[Row]) -> None:
        """Hands ``rows`` to ``exporters`` in batches: as rows to those that write rows
        themselves (``writes_rows``), as the SDK's spans (built once) to the others."""
        spans: list[ReadableSpan] | None = None
        size = self.batch_size
        for exporter in exporters:
            if getattr(exporter, "writes_rows", False):
                for begin in range(0, len(rows), size):
                    exporter.export_rows(  # type: ignore[attr-defined]
                        RowBatch(
                            self.resource, self._scope, rows[begin : begin + size], self._readable
                        )
                    )
                continue
            if spans is None:
                spans = [self._readable(row) for row in rows]
            for begin in range(0, len(spans), size):
                exporter.export(spans[begin : begin + size])

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        """Exports every finished span now; then asks each exporter to flush."""
        with self._lock:
            columns = self._take()
        self._export(columns)
        return all(e.force_flush(timeout_millis) for e in (*self._exporters, *self._synchronous))

    def shutdown(self) -> None:
        """Exports what is left and shuts every exporter down (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            columns = self._take()
        self._export(columns)
        for exporter in (*self._exporters, *self._synchronous):
            exporter.shutdown()
