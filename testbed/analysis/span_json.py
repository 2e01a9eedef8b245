"""OTLP JSON lines (a span file) → span and event tables (``testbed.core.telemetry.span_table``).

The fallback of ``load_spans`` for a process without a columnar copy (one that did not shut
down, a collector's file, a run written before copies existed). The file is parsed by
pyarrow's JSON reader; the OTLP nesting (resource → scope → span → attributes) is flattened
with list kernels, and attributes are pivoted per key (one sort, then a slice per key) into
the column types the columnar writer gives the same values.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj

from testbed.core.telemetry import span_table as st

_BLOCK_BYTES = 64 << 20  # larger than any line the exporter writes (one batch of spans)
_SCALAR_FIELDS = {
    "intValue": pa.int64(),
    "doubleValue": pa.float64(),
    "boolValue": pa.bool_(),
    "stringValue": st.STRING,
    "bytesValue": st.STRING,  # hex, as the columnar writer keeps bytes
}


def read_tables(path: Path) -> tuple[pa.Table, pa.Table]:
    """The span and event tables of the span file ``path`` (empty tables when it is empty)."""
    if path.stat().st_size == 0:
        return _empty(st.SPAN_COLUMNS), _empty(st.EVENT_COLUMNS)
    table = pj.read_json(path, read_options=pj.ReadOptions(block_size=_BLOCK_BYTES))
    resource_spans, resource_line = _flatten(table.column("resourceSpans"))
    scope_spans, scope_parent = _flatten(pc.struct_field(resource_spans, "scopeSpans"))
    spans, span_parent = _flatten(pc.struct_field(scope_spans, "spans"))
    if len(spans) == 0:
        return _empty(st.SPAN_COLUMNS), _empty(st.EVENT_COLUMNS)
    resource_index = pc.take(scope_parent, span_parent)
    return _spans(spans, resource_spans, resource_index), _events(spans)


def _spans(
    spans: pa.StructArray, resource_spans: pa.StructArray, resource_index: pa.Array
) -> pa.Table:
    status = pc.struct_field(spans, "status")
    message = _field(status, "message")
    columns: dict[str, pa.Array] = {
        "trace_id": pc.struct_field(spans, "traceId"),
        "span_id": pc.struct_field(spans, "spanId"),
        "parent_span_id": pc.fill_null(pc.struct_field(spans, "parentSpanId"), ""),
        "name": pc.struct_field(spans, "name"),
        "kind": pc.struct_field(spans, "kind"),
        "status": pc.struct_field(status, "code"),
        "start": pc.struct_field(spans, "startTimeUnixNano"),
        "end": pc.struct_field(spans, "endTimeUnixNano"),
        "status_message": message if message is not None else pa.nulls(len(spans)),
        "links": _links(spans),
    }
    columns = {name: columns[name].cast(type_) for name, type_ in st.SPAN_COLUMNS}
    resource_attributes = pc.struct_field(pc.struct_field(resource_spans, "resource"), "attributes")
    for key, column in _pivot(resource_attributes, len(resource_spans)).items():
        columns[st.RESOURCE + key] = column.take(resource_index)
    attributes = _field(spans, "attributes")
    if attributes is not None:
        for key, column in _pivot(attributes, len(spans)).items():
            columns[st.ATTRIBUTE + key] = column
    return pa.table(columns)


def _events(spans: pa.StructArray) -> pa.Table:
    events_column = _field(spans, "events")
    if events_column is None:
        return _empty(st.EVENT_COLUMNS)
    events, parent = _flatten(events_column)
    columns: dict[str, pa.Array] = {
        "trace_id": pc.take(pc.struct_field(spans, "traceId"), parent),
        "span_id": pc.take(pc.struct_field(spans, "spanId"), parent),
        "span_name": pc.take(pc.struct_field(spans, "name"), parent),
        "event": pc.struct_field(events, "name") if len(events) else pa.array([], st.STRING),
        "time": pc.struct_field(events, "timeUnixNano")
        if len(events)
        else pa.array([], pa.int64()),
    }
    columns = {name: columns[name].cast(type_) for name, type_ in st.EVENT_COLUMNS}
    attributes = _field(events, "attributes") if len(events) else None
    if attributes is not None:
        for key, column in _pivot(attributes, len(events)).items():
            columns[st.ATTRIBUTE + key] = column
    return pa.table(columns)


def _pivot(attributes: pa.Array, num_rows: int) -> dict[str, pa.Array]:
    """OTLP key/value lists → one typed array of ``num_rows`` per key (first-seen order)."""
    flat, parent = _flatten(attributes)
    if len(flat) == 0:
        return {}
    encoded = pc.struct_field(flat, "key").dictionary_encode()
    codes = encoded.indices.to_numpy()
    order = np.argsort(codes, kind="stable")
    bounds = np.searchsorted(codes[order], np.arange(len(encoded.dictionary) + 1))
    values = pc.struct_field(flat, "value")
    rows = parent.to_numpy()
    columns = {}
    for code, key in enumerate(encoded.dictionary.to_pylist()):
        picked = order[bounds[code] : bounds[code + 1]]
        typed = _typed(values.take(pa.array(picked)))
        columns[key] = st.scatter(typed, rows[picked], num_rows)
    return columns


def _typed(values: pa.StructArray) -> pa.Array:
    """Any-values as the column the columnar writer makes of the same values."""
    for name, type_ in _SCALAR_FIELDS.items():
        column = _field(values, name)
        if column is not None and column.null_count == 0:
            return column.cast(type_)
    arrays = _field(values, "arrayValue")
    if arrays is not None and arrays.null_count == 0:
        items = pc.struct_field(arrays, "values")
        elements = pc.list_flatten(items)
        if len(elements) == 0:
            return pa.ListArray.from_arrays(_offsets(items), pa.nulls(0))
        for name, type_ in _SCALAR_FIELDS.items():
            column = _field(elements, name)
            if column is not None and column.null_count == 0:
                return pa.ListArray.from_arrays(_offsets(items), column.cast(type_))
    return st.to_array([_python(row) for row in values.to_pylist()], st.MIXED)


def _python(row: dict[str, Any] | None) -> Any:
    """One any-value as the Python value the span held (a list for an array)."""
    for name, value in (row or {}).items():
        if value is None:
            continue
        if name == "intValue":
            return int(value)
        if name == "arrayValue":
            return [_python(v) for v in value.get("values") or []]
        return value
    return None


def _links(spans: pa.StructArray) -> pa.Array:
    links = _field(spans, "links")
    if links is None:
        return pa.nulls(len(spans), pa.list_(st.STRING))
    links = _chunk(links)
    flat = pc.list_flatten(links)
    pairs = pc.binary_join_element_wise(
        pc.struct_field(flat, "traceId"), pc.struct_field(flat, "spanId"), ":"
    )
    empty = pc.equal(pc.list_value_length(links), 0)
    mask = pc.or_(pc.is_null(links), pc.fill_null(empty, True))
    return pa.ListArray.from_arrays(_offsets(links), pairs, mask=mask)


def _offsets(lists: pa.ListArray) -> pa.Array:
    """The offsets of ``lists`` into its :func:`pc.list_flatten` (a slice's start at 0)."""
    offsets = lists.offsets
    return pc.subtract(offsets, offsets[0])


def _flatten(array: pa.Array | pa.ChunkedArray) -> tuple[pa.Array, pa.Array]:
    """A list array's values and, for each value, the index of the list it came from."""
    array = _chunk(array)
    return pc.list_flatten(array), pc.list_parent_indices(array)


def _chunk(array: pa.Array | pa.ChunkedArray) -> pa.Array:
    return array.combine_chunks() if isinstance(array, pa.ChunkedArray) else array


def _field(struct: pa.StructArray, name: str) -> pa.Array | None:
    if struct.type.get_field_index(name) < 0:
        return None
    return pc.struct_field(struct, name)


def _empty(columns: tuple[tuple[str, pa.DataType], ...]) -> pa.Table:
    return pa.schema(list(columns)).empty_table()
