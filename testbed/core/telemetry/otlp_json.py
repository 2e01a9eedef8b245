"""OTLP JSON encoding of finished spans.

Each line of a span file is one ``TracesData`` object in the OTLP/JSON encoding (the format of
the OpenTelemetry Collector's file exporter): ``resourceSpans → scopeSpans → spans``, trace and
span ids as lowercase hex, enums as integers, 64-bit integers (times, int attributes) as
decimal strings. :mod:`testbed.analysis` reads these files back; the span files themselves are
written by :mod:`testbed.core.telemetry.span_file` (as text, :mod:`~.otlp_text`, equal to this
encoding once parsed).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan

from testbed.core.telemetry.otlp_codes import KIND, STATUS


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
        "kind": KIND[span.kind],
        "startTimeUnixNano": str(span.start_time),
        "endTimeUnixNano": str(span.end_time),
        "attributes": key_values(span.attributes),
        "status": {"code": STATUS[span.status.status_code]},
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


_Groups = dict[int, tuple[Any, dict[tuple[str, str], list[ReadableSpan]]]]


def group_spans(spans: Sequence[ReadableSpan]) -> _Groups:
    """``spans`` by resource, then by instrumentation scope (name, version), in order of first
    appearance: the order a ``TracesData`` object holds them in."""
    by_resource: _Groups = {}
    for span in spans:
        resource_group = by_resource.setdefault(id(span.resource), (span.resource, {}))
        scope = span.instrumentation_scope
        scope_key = (scope.name, scope.version or "") if scope else ("", "")
        resource_group[1].setdefault(scope_key, []).append(span)
    return by_resource


def encode_traces_data(spans: Sequence[ReadableSpan] | _Groups) -> dict[str, Any]:
    """One OTLP ``TracesData`` object holding ``spans`` (or their :func:`group_spans`)."""
    by_resource = spans if isinstance(spans, dict) else group_spans(spans)
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
