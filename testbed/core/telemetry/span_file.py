"""The JSON-lines span file exporter: each exported batch one OTLP JSON line.

Lines go through ``testbed.core.append_file``: a line that cannot be written (a full disk) is kept
and written later, never torn; what is finally lost is counted (:attr:`lost_spans`, which
``testbed.core.telemetry.setup`` takes off the exported count), and the process goes on.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from testbed.core.append_file import AppendFile
from testbed.core.telemetry.otlp_json import group_spans
from testbed.core.telemetry.otlp_text import (
    fields_text,
    resource_spans_text,
    scope_spans_text,
    span_text,
    traces_data_text,
)
from testbed.core.telemetry.row_span import RowBatch, SpanFields


class JsonLinesSpanExporter(SpanExporter):
    """Appends each exported batch as one OTLP JSON line to ``path``; with ``columnar``, also
    keeps the columnar copy of the file (:mod:`testbed.core.telemetry.columnar`), finished when
    the exporter shuts down."""

    def __init__(self, path: Path, columnar: bool = False) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = AppendFile(path, "spans")
        self._lock = threading.Lock()
        self._columnar = None
        if columnar:  # pyarrow, where installed (the lab): imported only when asked for
            from testbed.core.telemetry.columnar import ColumnarSpanWriter

            self._columnar = ColumnarSpanWriter(path)

    @property
    def lost_spans(self) -> int:
        """Spans accepted (``SUCCESS``) but never written: still pending at shutdown."""
        return self._file.lost_items

    @property
    def first_error(self) -> str | None:
        return self._file.first_error

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        groups = group_spans(spans)
        line = (traces_data_text(groups) + "\n").encode()  # encode_traces_data, as text
        with self._lock:
            written = self._file.append(line, len(spans))
            if written and self._columnar is not None:
                self._columnar.add(
                    [
                        span
                        for _, scopes in groups.values()
                        for group in scopes.values()
                        for span in group
                    ]
                )
        return SpanExportResult.SUCCESS if written else SpanExportResult.FAILURE

    writes_rows = True
    """The recorder hands this exporter its rows (:meth:`export_rows`), not the SDK's spans."""

    def export_rows(self, batch: RowBatch) -> SpanExportResult:
        """As :meth:`export` for the recorder's rows of one resource and scope: the same line,
        written from the rows (the rows the fast encoding does not take, from their SDK span)."""
        texts = []
        fields: list[SpanFields | ReadableSpan] = []
        for row in batch.rows:
            context, attributes = row[1], row[6]
            if context.trace_state or type(attributes) is not dict:  # as span_text sees them
                span = batch.readable(row)
                fields.append(span)
                texts.append(span_text(span))
            else:
                row_fields = SpanFields.of_row(row)
                fields.append(row_fields)
                texts.append(fields_text(row_fields))
        scope = batch.scope
        line = '{"resourceSpans":[' + resource_spans_text(
            batch.resource, [scope_spans_text(scope.name, scope.version or "", texts)]
        ) + "]}\n"  # fmt: skip
        with self._lock:
            written = self._file.append(line.encode(), len(texts))
            if written and self._columnar is not None:
                self._columnar.add_fields(fields, batch.resource)
        return SpanExportResult.SUCCESS if written else SpanExportResult.FAILURE

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()
            if self._columnar is not None:
                if self._file.lost_items:  # the copy would hold spans the file lacks
                    self._columnar.discard()
                else:
                    self._columnar.close()
                self._columnar = None

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        with self._lock:
            return self._file.retry()
