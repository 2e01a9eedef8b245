"""OTLP's enum values for span kinds and status codes, shared by the span file writers and the
columnar span table (kept free of pyarrow: the connector and the server run without it)."""

from __future__ import annotations

from opentelemetry.trace import SpanKind, StatusCode

KIND = {
    SpanKind.INTERNAL: 1,
    SpanKind.SERVER: 2,
    SpanKind.CLIENT: 3,
    SpanKind.PRODUCER: 4,
    SpanKind.CONSUMER: 5,
}
"""OTLP's ``SpanKind`` enum values."""
STATUS = {StatusCode.UNSET: 0, StatusCode.OK: 1, StatusCode.ERROR: 2}
"""OTLP's ``StatusCode`` enum values."""
