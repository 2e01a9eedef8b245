"""OTLP JSON text written directly from finished spans (the span files' lines).

The same document as ``json.dumps(encode_traces_data(...))`` of
:mod:`testbed.core.telemetry.otlp_json` (equal once parsed), built as text: no dictionary per span,
per attribute and per value on the way, and each attribute key's ``{"key":...,"value":``
prefix made once per process. It runs on the SDK's export thread, which shares the
interpreter with the engine's. Spans with a trace state or dropped counts (rare) take the
dictionary route.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from json.encoder import encode_basestring_ascii as _string
from typing import Any

from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.trace import Link

from testbed.core.telemetry.otlp_codes import KIND, STATUS
from testbed.core.telemetry.otlp_json import any_value, encode_span, key_values
from testbed.core.telemetry.row_span import SpanFields

_prefixes: dict[str, str] = {}


def traces_data_text(
    groups: Mapping[int, tuple[Any, Mapping[tuple[str, str], list[ReadableSpan]]]],
) -> str:
    """The ``TracesData`` of spans grouped as ``otlp_json.group_spans`` groups them."""
    resources = []
    for resource, scopes in groups.values():
        scope_texts = [
            scope_spans_text(name, version, map(span_text, spans))
            for (name, version), spans in scopes.items()
        ]
        resources.append(resource_spans_text(resource, scope_texts))
    return '{"resourceSpans":[' + ",".join(resources) + "]}"


def resource_spans_text(resource: Any, scope_texts: Iterable[str]) -> str:
    """One ``ResourceSpans`` object: ``resource`` and its scopes' :func:`scope_spans_text`."""
    attributes = json.dumps(key_values(resource.attributes), separators=(",", ":"))
    return (
        '{"resource":{"attributes":' + attributes + '},"scopeSpans":['
        + ",".join(scope_texts) + "]}"
    )  # fmt: skip


def scope_spans_text(name: str, version: str, span_texts: Iterable[str]) -> str:
    """One ``ScopeSpans`` object: the scope and its spans' texts."""
    scope = '{"name":' + _string(name) + (',"version":' + _string(version) if version else "")
    return '{"scope":' + scope + '},"spans":[' + ",".join(span_texts) + "]}"


def span_text(span: ReadableSpan) -> str:
    """One span's OTLP JSON object."""
    context = span.get_span_context()
    assert context is not None
    if context.trace_state or _has_dropped(span):
        return json.dumps(encode_span(span), separators=(",", ":"))
    return fields_text(SpanFields.of_span(span))


def fields_text(span: SpanFields) -> str:
    """A span's OTLP JSON object from its fields (no trace state, nothing dropped:
    :func:`span_text` encodes the other spans)."""
    status = span.status
    text = (
        f'{{"traceId":"{span.trace_id}","spanId":"{span.span_id}",'
        f'"parentSpanId":"{span.parent_id}","name":{_string(span.name)},"kind":{KIND[span.kind]},'
        f'"startTimeUnixNano":"{span.start}","endTimeUnixNano":"{span.end}",'
        f'"attributes":{attributes_text(span.attributes)},'
        f'"status":{{"code":{STATUS[status.status_code]}'
        + (f',"message":{_string(status.description)}}}' if status.description else "}")
    )
    if span.events:
        text += ',"events":[' + ",".join(map(event_text, span.events)) + "]"
    if span.links:
        text += ',"links":[' + ",".join(map(link_text, span.links)) + "]"
    return text + "}"


def event_text(event: Event) -> str:
    """One span event's OTLP JSON object."""
    return (
        f'{{"timeUnixNano":"{event.timestamp}","name":{_string(event.name)},'
        f'"attributes":{attributes_text(event.attributes)}}}'
    )


def link_text(link: Link) -> str:
    """One span link's OTLP JSON object."""
    return (
        f'{{"traceId":"{link.context.trace_id:032x}","spanId":"{link.context.span_id:016x}",'
        f'"attributes":{attributes_text(link.attributes)}}}'
    )


def attributes_text(attributes: Mapping[str, Any] | None) -> str:
    """OTLP ``KeyValue`` list of ``attributes``."""
    if not attributes:
        return "[]"
    parts = []
    for key, value in attributes.items():
        prefix = _prefixes.get(key)
        if prefix is None:
            prefix = _prefixes[key] = '{"key":' + _string(key) + ',"value":'
        kind = type(value)  # the commonest two written here: a call less per attribute
        if kind is int:
            parts.append(f'{prefix}{{"intValue":"{value}"}}}}')
        elif kind is str:
            parts.append(prefix + '{"stringValue":' + _string(value) + "}}")
        else:
            parts.append(prefix + value_text(value) + "}")
    return "[" + ",".join(parts) + "]"


def value_text(value: Any) -> str:
    """An OTLP ``AnyValue``, as ``otlp_json.any_value`` makes it."""
    kind = type(value)
    if kind is str:
        return '{"stringValue":' + _string(value) + "}"
    if kind is int:
        return f'{{"intValue":"{value}"}}'
    if kind is float and math.isfinite(value):
        return f'{{"doubleValue":{value!r}}}'
    if kind is bool:
        return '{"boolValue":true}' if value else '{"boolValue":false}'
    if kind is tuple or kind is list:
        return '{"arrayValue":{"values":[' + ",".join(map(value_text, value)) + "]}}"
    return json.dumps(any_value(value), separators=(",", ":"))


def _has_dropped(span: ReadableSpan) -> bool:
    return bool(span.dropped_attributes or span.dropped_events or span.dropped_links)
