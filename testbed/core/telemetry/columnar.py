"""The columnar copy of a process's span file, written as spans are exported (any process).

:class:`ColumnarSpanWriter` takes the batches the JSON-lines exporter wrote
(:mod:`testbed.core.telemetry.otlp_json`, on the SDK's export thread) and keeps them as columns:
one Python list per column, values appended as they come. Every :data:`FLUSH_ROWS` spans the
columns become an Arrow record batch, appended to a scratch file (``<final>.part``) as one
IPC stream; memory holds at most one flush's spans. :meth:`ColumnarSpanWriter.close` (at
tracing's shutdown) rewrites the scratch streams, with one schema
(:func:`testbed.core.telemetry.span_table.unify`) and spans in start-time order (read back from
the memory-mapped scratch file, written a slice at a time), into ``<final>.tmp`` and renames
it into place:
events first, then spans. A columnar copy therefore exists only once whole; a process that
never shut down leaves none, and readers use its JSON lines.

The copy is an index for fast loading, never the record: when it cannot be written (a full
disk, anything else) the writer stops, removes its files, logs why once, and the JSON lines,
which hold every span, are what the run has.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from opentelemetry.sdk.trace import ReadableSpan

from testbed.core.telemetry import span_table as st
from testbed.core.telemetry.otlp_codes import KIND, STATUS
from testbed.core.telemetry.row_span import SCALARS, SpanFields

log = logging.getLogger(__name__)

COMPRESSION_ENV = "KVTB_SPAN_COMPRESSION"
"""Compresses the copy's record batches: ``lz4`` or ``zstd`` (unset or ``none``: plain). Span
columns repeat (names, keys, a trace's ids): on a replay's spans, ``zstd`` writes about a tenth
of the plain copy's bytes and ``lz4`` a quarter, and both load at half the plain copy's speed or
less (a plain copy is read in place, memory-mapped: docs/telemetry.md has the figures)."""
COMPRESSIONS = ("lz4", "zstd")

FLUSH_ROWS = 32768
"""Spans (or events) kept as Python columns before they become a record batch on disk."""


class _Columns:
    """Rows under construction: fixed columns plus sparse keyed ones (row index, value)."""

    def __init__(
        self, fixed: Sequence[tuple[str, pa.DataType]], prefix: str = st.ATTRIBUTE
    ) -> None:
        self.fixed = fixed
        self.prefix = prefix
        """Of the keyed columns' names (``a:``, ``r:``)."""
        self.values: list[list[Any]] = [[] for _ in fixed]
        self.keyed: dict[str, tuple[list[int], list[Any]]] = {}
        self.rows = 0

    def add_keyed(self, attributes: Any) -> None:
        row = self.rows
        keyed = self.keyed
        for key, value in attributes.items():
            column = keyed.get(key)
            if column is None:
                column = keyed[key] = ([], [])
            column[0].append(row)
            column[1].append(value if type(value) in SCALARS else st.plain(value))

    def batch(self, extra: dict[str, pa.Array] | None = None) -> pa.RecordBatch:
        arrays = {
            name: pa.array(v, t) for (name, t), v in zip(self.fixed, self.values, strict=True)
        }
        arrays.update(extra or {})
        for key, (rows, values) in self.keyed.items():
            array = st.to_array(values, st.type_of(values))
            arrays[self.prefix + key] = st.scatter(
                array, np.asarray(rows, dtype=np.int64), self.rows
            )
        return pa.RecordBatch.from_pydict(arrays)


class _Stage:
    """One output (spans or events): its scratch file of IPC streams and the final file."""

    def __init__(self, final: Path, sort_by: str | None = None) -> None:
        self.final = final
        self.sort_by = sort_by
        """The column the final file's rows are in (stable) order of (``None``: as added)."""
        self.scratch = final.with_name(final.name + ".part")
        self.segments: list[tuple[int, int]] = []
        self._fd = os.open(self.scratch, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        self._size = 0

    def append(self, batch: pa.RecordBatch) -> None:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, batch.schema, options=_write_options()) as stream:
            stream.write_batch(batch)
        data = sink.getvalue()
        written = os.write(self._fd, memoryview(data))
        if written != len(data):
            raise OSError(f"short write to {self.scratch}")
        self.segments.append((self._size, written))
        self._size += written

    def finish(self) -> None:
        """Rewrites the segments with one schema into ``final`` (via a temporary name)."""
        os.close(self._fd)
        self._fd = -1
        source = pa.memory_map(str(self.scratch))
        mapped = source.read_buffer()  # zero-copy: the tables below point into the mapping
        tables = [
            pa.ipc.open_stream(mapped.slice(offset, length)).read_all()
            for offset, length in self.segments
        ]
        tables = st.unify(tables) if tables else []
        schema = (tables[0].schema if tables else pa.schema([])).with_metadata(
            {st.LAYOUT_KEY: st.LAYOUT}
        )
        tables = [table.replace_schema_metadata(schema.metadata) for table in tables]
        temporary = self.final.with_name(self.final.name + ".tmp")
        with (
            pa.OSFile(str(temporary), "wb") as sink,
            pa.ipc.new_file(sink, schema, options=_write_options()) as out,
        ):
            if tables and self.sort_by is not None:
                table = pa.concat_tables(tables)  # the segments stay mapped, not copied
                order = np.argsort(table.column(self.sort_by).to_numpy(), kind="stable")
                for first in range(0, len(order), FLUSH_ROWS):
                    out.write_table(_take(table, order[first : first + FLUSH_ROWS]))
            else:
                for table in tables:
                    out.write_table(table)
        source.close()
        os.replace(temporary, self.final)
        self.scratch.unlink()

    def discard(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1
        for path in (self.scratch, self.final.with_name(self.final.name + ".tmp"), self.final):
            with contextlib.suppress(OSError):
                path.unlink()


def _write_options() -> pa.ipc.IpcWriteOptions:
    """Record batches compressed as :data:`COMPRESSION_ENV` asks (readers decompress them as
    they read, with nothing to give); a codec this pyarrow lacks, or an unknown name, is
    refused with one warning and the copy is written plain."""
    asked = os.environ.get(COMPRESSION_ENV, "").strip().lower()
    if asked in ("", "none"):
        return pa.ipc.IpcWriteOptions()
    if asked not in COMPRESSIONS or not pa.Codec.is_available(asked):
        _warn_once(
            f"{COMPRESSION_ENV}={asked!r}: not a codec of this pyarrow (one of "
            f"{', '.join(COMPRESSIONS)}, or none); the span copy is written uncompressed"
        )
        return pa.ipc.IpcWriteOptions()
    return pa.ipc.IpcWriteOptions(compression=asked)


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning("%s", message)


def _take(table: pa.Table, rows: np.ndarray) -> pa.Table:
    """``table.take(rows)`` from the slice of ``table`` the rows fall in: a take joins the
    chunks it reads from, and spans end soon after they start, so a slice of the start order
    comes from a few neighbouring segments, not all of them."""
    low = int(rows.min())
    window = table.slice(low, int(rows.max()) - low + 1)
    return window.take(rows - low)


class ColumnarSpanWriter:
    """Builds the columnar copy of the span file ``span_file`` (see the module docstring).
    Not thread-safe: the exporter calls it under its own lock."""

    def __init__(self, span_file: Path, flush_rows: int = FLUSH_ROWS) -> None:
        spans_path, events_path = st.columnar_paths(span_file)
        self.flush_rows = flush_rows
        self.error: str | None = None
        """Why the copy was given up (``None``: it was not)."""
        self._spans = _Columns(st.SPAN_COLUMNS)
        self._events = _Columns(st.EVENT_COLUMNS)
        self._resource_rows: list[int] = []
        self._resources: dict[int, tuple[int, Any]] = {}
        self._stages: tuple[_Stage, _Stage] | None = None
        # pyarrow.compute takes a while to import: not at shutdown, on a run's critical path.
        threading.Thread(
            target=importlib.import_module, args=("pyarrow.compute",), daemon=True
        ).start()
        try:
            self._stages = (_Stage(spans_path, sort_by="start"), _Stage(events_path))
        except OSError as exc:
            self._give_up(exc)

    def add(self, spans: Sequence[ReadableSpan]) -> None:
        """Appends ``spans`` (in the order the span file holds them)."""
        if self._stages is None:
            return
        try:
            for span in spans:
                self._add(span)
            if self._spans.rows >= self.flush_rows or self._events.rows >= self.flush_rows:
                self._flush()
        except Exception as exc:  # the copy is optional; the JSON lines hold the spans
            self._give_up(exc)

    def close(self) -> bool:
        """Writes the final files; True when the columnar copy is complete."""
        if self._stages is None:
            return False
        try:
            self._flush()
            events, spans = self._stages[1], self._stages[0]
            events.finish()
            spans.finish()  # last: the spans file's presence says the copy is whole
        except Exception as exc:
            self._give_up(exc)
            return False
        self._stages = None
        return True

    def discard(self) -> None:
        """Removes the copy (its spans file would hold spans the span file lacks)."""
        for stage in self._stages or ():
            stage.discard()
        self._stages = None

    def add_fields(self, spans: Sequence[SpanFields | ReadableSpan], resource: Any) -> None:
        """Appends spans of ``resource`` given by their fields (the SDK's spans among them,
        read as :meth:`add` reads them)."""
        if self._stages is None:
            return
        try:
            for span in spans:
                if isinstance(span, SpanFields):
                    self._add_fields(span, resource)
                else:
                    self._add(span)
            if self._spans.rows >= self.flush_rows or self._events.rows >= self.flush_rows:
                self._flush()
        except Exception as exc:  # the copy is optional; the JSON lines hold the spans
            self._give_up(exc)

    def _add(self, span: ReadableSpan) -> None:
        self._add_fields(SpanFields.of_span(span), span.resource)

    def _add_fields(self, span: SpanFields, resource: Any) -> None:
        known = self._resources.get(id(resource))
        if known is None:
            known = self._resources[id(resource)] = (len(self._resources), resource)
        self._resource_rows.append(known[0])
        if span.attributes:
            self._spans.add_keyed(span.attributes)
        for event in span.events or ():
            self._events.add_keyed(event.attributes or {})
            for column, value in zip(
                self._events.values,
                (span.trace_id, span.span_id, span.name, event.name, event.timestamp),
                strict=True,
            ):
                column.append(value)
            self._events.rows += 1
        row = (
            span.trace_id,
            span.span_id,
            span.parent_id,
            span.name,
            KIND[span.kind],
            STATUS[span.status.status_code],
            span.start,
            span.end,
            span.status.description or None,
            [f"{link.context.trace_id:032x}:{link.context.span_id:016x}" for link in span.links]
            if span.links
            else None,
        )
        for column, value in zip(self._spans.values, row, strict=True):
            column.append(value)
        self._spans.rows += 1

    def _flush(self) -> None:
        assert self._stages is not None
        if self._spans.rows:
            self._stages[0].append(self._spans.batch(self._resource_columns()))
        if self._events.rows:
            self._stages[1].append(self._events.batch())
        self._spans, self._events = _Columns(st.SPAN_COLUMNS), _Columns(st.EVENT_COLUMNS)
        self._resource_rows, self._resources = [], {}

    def _resource_columns(self) -> dict[str, pa.Array]:
        """``r:<key>`` columns: each resource's attributes, taken for the rows it made."""
        per_resource = _Columns((), prefix=st.RESOURCE)
        for _, resource in self._resources.values():
            per_resource.add_keyed(resource.attributes)
            per_resource.rows += 1
        rows = pa.array(self._resource_rows, pa.int64())
        table = per_resource.batch()
        return {name: table.column(name).take(rows) for name in table.schema.names}

    def _give_up(self, exc: BaseException) -> None:
        self.error = f"{type(exc).__name__}: {exc}"
        log.warning(
            "no columnar span copy (%s); the span file's JSON lines hold the spans", self.error
        )
        self.discard()
