"""OTLP JSON encoding of finished spans, and the JSON-lines file exporter.

Each line of a span file is one ``TracesData`` object in the OTLP/JSON encoding (the format of
the OpenTelemetry Collector's file exporter): ``resourceSpans → scopeSpans → spans``, trace and
span ids as lowercase hex, enums as integers, 64-bit integers (times, int attributes) as
decimal strings. :mod:`testbed.analysis` reads these files back.

Lines go through ``testbed.core.append_file``: a line that cannot be written (a full disk) is kept
and written later, never torn; what is finally lost is counted (:attr:`lost_spans`, which
``testbed.core.telemetry.setup`` takes off the exported count), and the process goes on.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind, StatusCode

from testbed.core.append_file import AppendFile

# OTLP's SpanKind and StatusCode enum values.
_KIND = {
    SpanKind.INTERNAL: 1,
    SpanKind.SERVER: 2,
    SpanKind.CLIENT: 3,
    SpanKind.PRODUCER: 4,
    SpanKind.CONSUMER: 5,
}
_STATUS = {StatusCode.UNSET: 0, StatusCode.OK: 1, StatusCode.ERROR: 2}


def any_value(value: Any) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        return {"doubleValue": value}
    if isinstance(value, bytes):
        return {"bytesValue": value.hex()}
    if isinstance(value, Sequence) and not isinstance(value, str):
        return {"arrayValue": {"values": [any_value(v) for v in value]}}
    return {"stringValue": str(value)}


def key_values(attributes: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    return [{"key": k, "value": any_value(v)} for k, v in (attributes or {}).items()]


def encode_span(span: ReadableSpan) -> dict[str, Any]:
    context = span.get_span_context()
    assert context is not None
    encoded: dict[str, Any] = {
        "traceId": f"{context.trace_id:032x}",
        "spanId": f"{context.span_id:016x}",
        "parentSpanId": f"{span.parent.span_id:016x}" if span.parent else "",
        "name": span.name,
        "kind": _KIND[span.kind],
        "startTimeUnixNano": str(span.start_time),
        "endTimeUnixNano": str(span.end_time),
        "attributes": key_values(span.attributes),
        "status": {"code": _STATUS[span.status.status_code]},
    }
    if context.trace_state:
        encoded["traceState"] = context.trace_state.to_header()
    if span.status.description:
        encoded["status"]["message"] = span.status.description
    if span.events:
        encoded["events"] = [
            {
                "timeUnixNano": str(event.timestamp),
                "name": event.name,
                "attributes": key_values(event.attributes),
            }
            for event in span.events
        ]
    if span.links:
        encoded["links"] = [
            {
                "traceId": f"{link.context.trace_id:032x}",
                "spanId": f"{link.context.span_id:016x}",
                "attributes": key_values(link.attributes),
            }
            for link in span.links
        ]
    for name, field in _DROPPED.items():
        count = getattr(span, name, 0)
        if count:
            encoded[field] = count
    return encoded


_DROPPED = {
    "dropped_attributes": "droppedAttributesCount",
    "dropped_events": "droppedEventsCount",
    "dropped_links": "droppedLinksCount",
}


def encode_traces_data(spans: Sequence[ReadableSpan]) -> dict[str, Any]:
    """One OTLP ``TracesData`` object holding ``spans``, grouped by resource and scope."""
    by_resource: dict[int, tuple[Any, dict[tuple[str, str], list[ReadableSpan]]]] = {}
    for span in spans:
        resource_group = by_resource.setdefault(id(span.resource), (span.resource, {}))
        scope = span.instrumentation_scope
        scope_key = (scope.name, scope.version or "") if scope else ("", "")
        resource_group[1].setdefault(scope_key, []).append(span)
    return {
        "resourceSpans": [
            {
                "resource": {"attributes": key_values(resource.attributes)},
                "scopeSpans": [
                    {
                        "scope": {"name": name, **({"version": version} if version else {})},
                        "spans": [encode_span(span) for span in scope_spans],
                    }
                    for (name, version), scope_spans in scopes.items()
                ],
            }
            for resource, scopes in by_resource.values()
        ]
    }


class JsonLinesSpanExporter(SpanExporter):
    """Appends each exported batch as one OTLP JSON line to ``path``."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = AppendFile(path, "spans")
        self._lock = threading.Lock()

    @property
    def lost_spans(self) -> int:
        """Spans accepted (``SUCCESS``) but never written: still pending at shutdown."""
        return self._file.lost_items

    @property
    def first_error(self) -> str | None:
        return self._file.first_error

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        line = (json.dumps(encode_traces_data(spans), separators=(",", ":")) + "\n").encode()
        with self._lock:
            written = self._file.append(line, len(spans))
        return SpanExportResult.SUCCESS if written else SpanExportResult.FAILURE

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        with self._lock:
            return self._file.retry()
