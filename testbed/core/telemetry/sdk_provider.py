"""The SDK's own tracer provider for ``TracingConfig.recorder=False`` (any process): its
processors count the spans that end, stamp the fleet instance and export in batches (or span
by span), at the SDK's cost per span. The run's processes record spans as rows instead
(:mod:`testbed.core.telemetry.recorder`); this provider stays as the reference the recorder is
compared with, column for column."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator

from testbed.core import telemetry
from testbed.core.telemetry import attributes as a

# Defaults chosen so that a run's bursts fit: the SDK's 2,048-span queue overflows silently.
_BSP_DEFAULTS = {
    "OTEL_BSP_MAX_QUEUE_SIZE": 1 << 18,
    "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": 4096,
    "OTEL_BSP_SCHEDULE_DELAY": 500,
}


class EndCounter(SpanProcessor):
    def __init__(self) -> None:
        self.ended = 0
        self._lock = threading.Lock()

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        return None

    def on_end(self, span: ReadableSpan) -> None:
        with self._lock:
            self.ended += 1


class InstanceStamp(SpanProcessor):
    """Stamps spans started inside :func:`testbed.core.telemetry.instance_scope` with the fleet
    instance (``kvcache.instance``), as ``kvcache.rank`` tells TP ranks apart in a process."""

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        instance = telemetry.current_instance.get()
        if instance is not None:
            span.set_attribute(a.INSTANCE, instance)


def sdk_provider(
    resource: Resource,
    sampler: Any,
    id_generator: IdGenerator,
    batched: Sequence[SpanExporter],
    synchronous: Sequence[SpanExporter],
) -> TracerProvider:
    """The SDK's own provider, with the instance stamp and ``synchronous`` and ``batched``
    exporters; the caller adds its :class:`EndCounter`."""
    provider = TracerProvider(resource=resource, id_generator=id_generator, sampler=sampler)
    provider.add_span_processor(InstanceStamp())
    for exporter in synchronous:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    for exporter in batched:
        provider.add_span_processor(_batch_processor(exporter))
    return provider


def _batch_processor(exporter: SpanExporter) -> BatchSpanProcessor:
    """A batch processor with our queue sizes, unless OTEL_BSP_* variables set them (the SDK
    reads a variable when the argument is ``None``)."""

    def setting(variable: str) -> int | None:
        return None if variable in os.environ else _BSP_DEFAULTS[variable]

    return BatchSpanProcessor(
        exporter,
        max_queue_size=setting("OTEL_BSP_MAX_QUEUE_SIZE"),
        max_export_batch_size=setting("OTEL_BSP_MAX_EXPORT_BATCH_SIZE"),
        schedule_delay_millis=setting("OTEL_BSP_SCHEDULE_DELAY"),
    )
