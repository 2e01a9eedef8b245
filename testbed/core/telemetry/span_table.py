"""The columnar span store's layout: one Arrow table per process, one row per span (or event).

A process's span file ``<stem>.jsonl`` (OTLP JSON lines, :mod:`testbed.core.telemetry.otlp_json`)
may have a columnar copy beside it, written when the process's tracing shut down
(:mod:`testbed.core.telemetry.columnar`): ``<stem>.spans.arrow`` and ``<stem>.events.arrow``, Arrow
IPC files. ``testbed.analysis`` reads both kinds of file into this same layout (a *span table*)
and builds its DataFrames from span tables only, so a run loads the same either way.

Span table columns, in order: ``trace_id, span_id, parent_span_id`` (hex strings; ``""`` for
roots), ``name``, ``kind`` and ``status`` (OTLP enum integers), ``start, end`` (ns since the
epoch), ``status_message`` (null when none), ``links`` (``"trace_id:span_id"`` strings; null
when none); then ``r:<key>`` per resource attribute and ``a:<key>`` per span attribute, in
order of first appearance. Event tables: ``trace_id, span_id, span_name, event, time`` and
``a:<key>`` per event attribute.

An attribute column has the one type all its values share: int64, float64, bool, (large)
string, or a
list of one of those. A key whose values differ in type (or a list mixing types) is stored as
:data:`MIXED`: each value as JSON text, decoded to Python values when loaded.

Values are taken as the OTLP JSON encoding sees them (:func:`plain`): bytes as hex text, any
other non-primitive as its ``str``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

LAYOUT_KEY, LAYOUT = b"kvtb.span_table", b"1"
"""Schema metadata of a columnar copy: the layout it was written in. A reader uses only
copies of its own layout (others load from their JSON lines)."""
SPANS_SUFFIX = ".spans.arrow"
EVENTS_SUFFIX = ".events.arrow"
RESOURCE = "r:"
ATTRIBUTE = "a:"
MIXED = pa.large_binary()
"""The type of a column whose values differ in type: JSON text per value."""

STRING = pa.large_string()
"""Strings are large strings: what pandas' ``str`` columns hold, taken without a cast."""
SPAN_KEY: tuple[tuple[str, pa.DataType], ...] = (("trace_id", STRING), ("span_id", STRING))
"""The columns that name a span: first in the span table, and in the event table, whose rows
name their span by them."""
SPAN_COLUMNS: tuple[tuple[str, pa.DataType], ...] = (
    *SPAN_KEY,
    ("parent_span_id", STRING),
    ("name", STRING),
    ("kind", pa.int64()),
    ("status", pa.int64()),
    ("start", pa.int64()),
    ("end", pa.int64()),
    ("status_message", STRING),
    ("links", pa.list_(STRING)),
)
EVENT_COLUMNS: tuple[tuple[str, pa.DataType], ...] = (
    *SPAN_KEY,
    ("span_name", STRING),
    ("event", STRING),
    ("time", pa.int64()),
)
_SCALARS: dict[type, pa.DataType] = {
    bool: pa.bool_(),
    int: pa.int64(),
    float: pa.float64(),
    str: STRING,
}


def columnar_paths(span_file: Path) -> tuple[Path, Path]:
    """The spans and events files of the columnar copy of ``span_file`` (a ``.jsonl``)."""
    stem = span_file.with_suffix("")
    return stem.with_name(stem.name + SPANS_SUFFIX), stem.with_name(stem.name + EVENTS_SUFFIX)


def plain(value: Any) -> Any:
    """An attribute value as the OTLP JSON encoding writes it: a primitive, or a tuple."""
    if type(value) in _SCALARS:
        return value
    for kind in (bool, int, float, str):  # subclasses (numpy's float64, enums) as the base
        if isinstance(value, kind):
            return kind(value)
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, Sequence):
        return tuple(plain(v) for v in value)
    return str(value)


def type_of(values: Sequence[Any]) -> pa.DataType:
    """The column type of plain attribute values (:data:`MIXED` when they differ)."""
    kinds = {type(v) for v in values}
    if len(kinds) != 1:
        return MIXED
    (kind,) = kinds
    if kind is not tuple:
        return _SCALARS[kind]
    elements = {type(e) for v in values for e in v}
    if not elements:
        return pa.list_(pa.null())
    if len(elements) != 1 or tuple in elements:
        return MIXED
    return pa.list_(_SCALARS[elements.pop()])


def to_array(values: Sequence[Any], type_: pa.DataType) -> pa.Array:
    """Plain values as an array of ``type_`` (:func:`type_of`); ``None`` entries are null."""
    if type_ == MIXED:
        return pa.array([None if v is None else _json(v) for v in values], MIXED)
    return pa.array(values, type_)


def scatter(values: pa.Array, rows: np.ndarray, num_rows: int) -> pa.Array:
    """An array of ``num_rows`` holding ``values[i]`` at ``rows[i]`` and nulls elsewhere."""
    if len(values) == num_rows and (num_rows == 0 or rows[-1] == num_rows - 1):
        return values
    index = np.full(num_rows, -1, dtype=np.int64)
    index[rows] = np.arange(len(rows))
    return values.take(pa.array(index, mask=index < 0))


def unify(tables: Sequence[pa.Table]) -> list[pa.Table]:
    """``tables`` with one schema: every column of any, in order of first appearance; a
    column missing from a table is null there; a column whose types differ becomes
    :data:`MIXED` (a list of nulls takes the other lists' type)."""
    types: dict[str, list[pa.DataType]] = {}
    for table in tables:
        for field in table.schema:
            types.setdefault(field.name, []).append(field.type)
    schema = pa.schema([(name, _common(found)) for name, found in types.items()])
    return [_conform(table, schema) for table in tables]


def _common(found: list[pa.DataType]) -> pa.DataType:
    distinct = set(found)
    if len(distinct) == 1:
        return found[0]
    known = {t for t in distinct if t != pa.list_(pa.null())}
    if len(known) == 1 and all(pa.types.is_list(t) for t in distinct):
        return known.pop()
    return MIXED


def _conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    if table.schema.equals(schema):
        return table
    columns = []
    for field in schema:
        if field.name not in table.column_names:
            columns.append(pa.nulls(table.num_rows, field.type))
            continue
        column = table.column(field.name)
        if column.type == field.type:
            columns.append(column)
        elif field.type == MIXED:
            columns.append(to_array(column.to_pylist(), MIXED))
        else:
            columns.append(column.cast(field.type))
    return pa.Table.from_arrays(columns, schema=schema)


def _json(value: Any) -> bytes:
    return json.dumps(list(value) if isinstance(value, tuple) else value).encode()


def read_columnar(span_file: Path) -> tuple[pa.Table, pa.Table] | None:
    """The span and event tables of ``span_file``'s columnar copy; ``None`` when there is
    none or it cannot be read (a process that did not shut down; a damaged file)."""
    spans_path, events_path = columnar_paths(span_file)
    if not spans_path.is_file():
        return None
    try:
        tables = tuple(
            pa.ipc.open_file(pa.memory_map(str(path))).read_all()
            for path in (spans_path, events_path)
        )
    except (OSError, pa.ArrowInvalid):
        return None
    if any((table.schema.metadata or {}).get(LAYOUT_KEY) != LAYOUT for table in tables):
        return None
    return tables[0], tables[1]
