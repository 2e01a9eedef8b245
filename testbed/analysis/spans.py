"""Reading span files (OTLP JSON lines) of a run or a sweep into tidy pandas DataFrames.

Both loaders take a run directory (one with ``spans/``), a sweep directory, or any directory
of run directories (e.g. the ``--out`` of several ``kvtb run``): then every *complete* run
(with ``summary.json``; in ``sweep.json`` order for a sweep, by name otherwise) contributes
its rows, told apart by ``run_id``. :func:`run_dirs` says which directories those are.

:func:`load_spans` gives one row per span with the columns

``trace_id, span_id, parent_span_id`` (hex; ``""`` for roots), ``name, kind`` (``INTERNAL``,
``SERVER``, ``CLIENT``, ...), ``service, rank, run_id`` (the resource's ``kvcache.run_id``, else
the run directory's name), ``start_time`` (UTC timestamps), ``end_time, duration_ms, status``
(``UNSET``, ``OK``, ``ERROR``), ``status_message``, ``links`` (a tuple of
``"trace_id:span_id"``, empty when none),
``resource.<key>`` per other resource attribute (the process's: engine, workload, chunk size,
...), then one column per span attribute under its own name (``kvcache.tokens.hit``, ...; see
``testbed.core.telemetry.attributes``). ``kvcache.instance`` (a fleet's instance) is the span's,
else
its process's (a vLLM server of a fleet names its instance in its resource). Rows of a run are
in start-time order.

:func:`load_events` gives the span events (one per request of a batched store or retrieve),
with the ``run_id`` of the run directory they were read from.
Each process's spans are read from its columnar copy (``<stem>.spans.arrow`` and
``<stem>.events.arrow`` beside ``<stem>.jsonl``, written when its tracing shut down) when it
has a whole one, else from its OTLP JSON lines (:mod:`testbed.analysis.span_json`); both give
the span tables of :mod:`testbed.core.telemetry.span_table`, and the DataFrames are built from
those alone, so a run loads to the same DataFrame either way.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from testbed.analysis.span_json import read_tables
from testbed.core.run_dir import SPANS_DIR, RunDir, SweepDir
from testbed.core.telemetry import attributes as a
from testbed.core.telemetry import span_table as st
from testbed.core.telemetry.setup import COLLECTED_PREFIX

_RUN_INDEX = "_run_index"  # while loading: which of the runs a span came from

KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
STATUSES = {0: "UNSET", 1: "OK", 2: "ERROR"}
BASE_COLUMNS = [
    "trace_id",
    "span_id",
    "parent_span_id",
    "name",
    "kind",
    "service",
    "rank",
    "run_id",
    "start_time",
    "end_time",
    "duration_ms",
    "status",
    "status_message",
    "links",
]


def span_files(run_dir: Path | str) -> list[Path]:
    directory = RunDir(Path(run_dir)).spans
    if not directory.is_dir():
        raise FileNotFoundError(
            f"{directory} does not exist: is {run_dir} a run directory (made by `kvtb run`)?"
        )
    return sorted(directory.glob("*.jsonl"))


def is_run_dir(path: Path | str) -> bool:
    return RunDir(Path(path)).has_spans()


def run_dirs(path: Path | str) -> list[Path]:
    """``[path]`` for a run directory; the complete runs of a sweep directory (in the sweep's
    order) or of a directory of run directories (by name)."""
    path = Path(path)
    if is_run_dir(path):
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"{path} does not exist")
    manifest = SweepDir(path).manifest
    if manifest.is_file():
        candidates = [path / run_id for run_id in json.loads(manifest.read_text())["runs"]]
    else:
        candidates = sorted(child for child in path.iterdir() if child.is_dir())
    runs = [run for run in candidates if is_run_dir(run) and RunDir(run).is_complete()]
    if not runs and not manifest.is_file():
        raise FileNotFoundError(
            f"{path} is neither a run directory (no {SPANS_DIR}/) nor a directory of complete "
            "runs (made by `kvtb run` or `kvtb sweep`)"
        )
    return runs


def load_spans(path: Path | str, *, columnar: bool = True) -> pd.DataFrame:
    """Every span of a run, a sweep or a directory of runs, one row each (see the module
    docstring for the columns). ``columnar=False`` reads the JSON lines even where a
    columnar copy exists (the two give the same DataFrame)."""
    with _collection_paused():
        return _load_spans(path, columnar)


def _load_spans(path: Path | str, columnar: bool) -> pd.DataFrame:
    runs = run_dirs(path)
    collected = any(
        file.name.startswith(COLLECTED_PREFIX) for run in runs for file in span_files(run)
    )
    parts = [
        (index, spans)
        for index, run in enumerate(runs)
        for spans, _ in _process_tables(run, columnar)
        if spans.num_rows
    ]
    if not parts:
        return pd.DataFrame(columns=BASE_COLUMNS)
    table = pa.concat_tables(st.unify([spans for _, spans in parts]))
    run_index = np.concatenate([np.full(spans.num_rows, index) for index, spans in parts])
    by_time = np.lexsort((table.column("start").to_numpy(), run_index))  # by run, then time
    order = None if np.all(by_time == np.arange(len(by_time))) else by_time
    if order is not None:
        run_index = run_index[order]
    spans = _span_frame(table, order)
    names = np.array([run.name for run in runs], dtype=object)
    spans["run_id"] = spans["run_id"].fillna(pd.Series(names[run_index], index=spans.index))
    if not collected:
        return spans
    # A span exported twice (to a span file and to a collector) counts once.
    duplicate = spans.duplicated(["run_id", "trace_id", "span_id"])
    return spans[~duplicate].reset_index(drop=True) if duplicate.any() else spans


def load_events(path: Path | str, *, columnar: bool = True) -> pd.DataFrame:
    """Every span event: ``trace_id, span_id, span_name, event, time, run_id`` and its
    attributes (of a run, a sweep or a directory of runs, as :func:`load_spans`)."""
    with _collection_paused():
        return _load_events(path, columnar)


def _load_events(path: Path | str, columnar: bool) -> pd.DataFrame:
    runs = run_dirs(path)
    parts = [
        (run.name, events)
        for run in runs
        for _, events in _process_tables(run, columnar)
        if events.num_rows
    ]
    if not parts:
        return pd.DataFrame(columns=["trace_id", "span_id", "span_name", "event", "time", "run_id"])
    table = pa.concat_tables(st.unify([events for _, events in parts]))
    run_ids = np.concatenate(
        [np.full(events.num_rows, name, dtype=object) for name, events in parts]
    )
    data: dict[str, Any] = {
        name: _column(table.column(name)) for name in ("trace_id", "span_id", "span_name", "event")
    }
    data["time"] = pd.to_datetime(table.column("time").to_numpy(), unit="ns", utc=True)
    data["run_id"] = pd.array(run_ids, dtype="str")
    for name in table.column_names[len(st.EVENT_COLUMNS) :]:
        data[name.removeprefix(st.ATTRIBUTE)] = _column(table.column(name))
    events = pd.DataFrame(data, copy=False)
    duplicate = events.duplicated(["run_id", "trace_id", "span_id", "event", "time"])
    return events[~duplicate].reset_index(drop=True) if duplicate.any() else events


@contextmanager
def _collection_paused() -> Iterator[None]:
    """No cyclic garbage collection while a load builds its objects (one Python list per
    list-valued attribute, none of them in a cycle): otherwise the collector's passes over
    everything the process holds, triggered by those allocations, cost as much as the load."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _process_tables(run_dir: Path, columnar: bool) -> list[tuple[pa.Table, pa.Table]]:
    """(span table, event table) of each process of a run: its columnar copy when whole."""
    tables = []
    for path in span_files(run_dir):
        found = st.read_columnar(path) if columnar else None
        tables.append(found if found is not None else read_tables(path))
    return tables


_SPECIAL = {"service.name": "service", "kvcache.run_id": "run_id", "kvcache.rank": "rank"}


def _span_frame(table: pa.Table, order: np.ndarray | None) -> pd.DataFrame:
    """The DataFrame of a span table (all runs), its rows taken in ``order`` (``None``: as
    they are), before ``run_id`` is filled in. Each column is reordered as it is converted
    (numpy takes on the converted arrays), which costs a fraction of reordering the table."""
    start, end = _numpy(table.column("start"), order), _numpy(table.column("end"), order)
    data: dict[str, Any] = {
        name: _column(table.column(name), order)
        for name in ("trace_id", "span_id", "parent_span_id", "name")
    }
    data["kind"] = _names(table.column("kind"), KINDS, order)
    special = {
        column: _column(table.column(st.RESOURCE + key), order)
        for key, column in _SPECIAL.items()
        if st.RESOURCE + key in table.column_names
    }
    data["service"] = special.get("service")
    data["rank"] = special.get("rank")
    data["run_id"] = special.get("run_id")
    data["start_time"] = pd.to_datetime(start, unit="ns", utc=True)
    data["end_time"] = pd.to_datetime(end, unit="ns", utc=True)
    data["duration_ms"] = (end - start) / 1e6
    data["status"] = _names(table.column("status"), STATUSES, order)
    data["status_message"] = _column(pc.fill_null(table.column("status_message"), ""), order)
    data["links"] = _reorder(_links(table.column("links")), order)
    attribute_rank = None
    keyed = table.column_names[len(st.SPAN_COLUMNS) :]
    # Every process's resource columns first, then the attributes (of any process).
    for name in sorted(keyed, key=lambda name: not name.startswith(st.RESOURCE)):
        if name.startswith(st.RESOURCE) and name.removeprefix(st.RESOURCE) not in _SPECIAL:
            data["resource." + name.removeprefix(st.RESOURCE)] = _column(
                table.column(name), order
            )
        elif name == st.ATTRIBUTE + "kvcache.rank":
            attribute_rank = pd.Series(_column(table.column(name), order))
        elif name.startswith(st.ATTRIBUTE):
            data[name.removeprefix(st.ATTRIBUTE)] = _column(table.column(name), order)
    if data["rank"] is None:  # no process has a rank
        data["rank"] = pd.arrays.IntegerArray(
            np.zeros(table.num_rows, np.int64), np.ones(table.num_rows, bool)
        )
    spans = pd.DataFrame(data, copy=False)
    if attribute_rank is not None:
        spans["rank"] = attribute_rank.combine_first(spans["rank"])
    if spans["rank"].dtype != "Int64":
        spans["rank"] = pd.to_numeric(spans["rank"]).astype("Int64")
    if f"resource.{a.INSTANCE}" in spans:  # a fleet's servers name their instance per process
        resource_instance = spans[f"resource.{a.INSTANCE}"]
        spans[a.INSTANCE] = (
            spans[a.INSTANCE].combine_first(resource_instance)
            if a.INSTANCE in spans
            else resource_instance
        )
    return spans


def _names(codes: pa.ChunkedArray, names: dict[int, str], order: np.ndarray | None) -> Any:
    """OTLP enum integers as their names (a string column)."""
    lookup = pa.array([names.get(code, str(code)) for code in range(max(names) + 1)], st.STRING)
    return _column(lookup.take(codes), order)


def _column(column: pa.ChunkedArray | pa.Array, order: np.ndarray | None = None) -> Any:
    """An attribute column as pandas holds it, its rows taken in ``order``: ``Int64``,
    ``boolean``, ``float64``, ``str``; lists and values of mixed types as Python objects;
    NaN/NA where a span has none."""
    type_ = column.type
    if pa.types.is_list(type_):
        return _reorder(_lists(column), order)
    if type_ == st.MIXED:
        return _reorder(_mixed(column), order)
    if type_ in _MASKED:
        values, mask = _values_and_mask(column)
        if order is not None:
            values, mask = values.take(order), mask.take(order)
        return _MASKED[type_](values, mask)
    if type_ == st.STRING:
        taken = column if order is None else column.take(order)
        return _STRING.__from_arrow__(taken)
    return _numpy(column, order)


_MASKED: dict[pa.DataType, Any] = {
    pa.int64(): pd.arrays.IntegerArray,
    pa.bool_(): pd.arrays.BooleanArray,
}
"""Arrow types pandas holds as masked arrays (``Int64``, ``boolean``)."""
_STRING = pd.StringDtype("pyarrow", na_value=np.nan)  # pandas' ``str``


def _numpy(column: pa.ChunkedArray | pa.Array, order: np.ndarray | None) -> np.ndarray:
    """A writable numpy array of ``column`` (NaN for a float's nulls) in ``order``."""
    values = column.to_numpy(zero_copy_only=False) if isinstance(column, pa.Array) else (
        column.to_numpy()
    )
    if order is not None:
        return values.take(order)
    return values if values.flags.writeable else values.copy()


def _values_and_mask(column: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """An ``int64`` or ``bool`` column's values and null mask, read from its buffers (new,
    writable arrays; a value under the mask is whatever the buffer holds there)."""
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    values, masks = [], []
    for chunk in chunks:
        validity, data = chunk.buffers()[:2]
        start, length = chunk.offset, len(chunk)
        if data is None:  # all null, no values buffer
            values.append(np.zeros(length, bool if chunk.type == pa.bool_() else np.int64))
        elif chunk.type == pa.bool_():
            values.append(_bits(data, start, length))
        else:
            values.append(np.frombuffer(data, np.int64, length, start * 8))
        if chunk.null_count:
            masks.append(~_bits(validity, start, length))
        else:
            masks.append(np.zeros(length, bool))
    if not chunks:
        return np.zeros(0, bool if column.type == pa.bool_() else np.int64), np.zeros(0, bool)
    return np.concatenate(values), np.concatenate(masks)


def _bits(buffer: pa.Buffer, start: int, length: int) -> np.ndarray:
    """``length`` bits of an Arrow bitmap from bit ``start``, as booleans."""
    packed = np.frombuffer(buffer, np.uint8)
    return np.unpackbits(packed, bitorder="little", count=start + length)[start:].astype(bool)


def _reorder(values: Any, order: np.ndarray | None) -> Any:
    """``values`` (a numpy array or a pandas extension array) in ``order``."""
    return values if order is None else values.take(order)


def _lists(column: pa.ChunkedArray) -> np.ndarray:
    """Python lists; NaN where a span has none."""
    result = np.full(len(column), np.nan, dtype=object)
    for row, value in _valid_lists(column):
        result[row] = value
    return result


def _links(column: pa.ChunkedArray) -> np.ndarray:
    """Tuples of ``"trace_id:span_id"``; one shared empty tuple where a span has none."""
    result = np.empty(len(column), dtype=object)
    result.fill(())
    for row, value in _valid_lists(column):
        result[row] = tuple(value)
    return result


def _valid_lists(column: pa.ChunkedArray) -> Iterator[tuple[int, list[Any]]]:
    """(row, Python list) of each non-null list: the values converted in one pass, then
    sliced (``to_pylist`` builds them one scalar at a time)."""
    lists = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    valid = np.flatnonzero(pc.is_valid(lists).to_numpy(zero_copy_only=False))
    if len(valid) == 0:
        return iter(())
    lists = lists.drop_null()
    offsets = pc.subtract(lists.offsets, lists.offsets[0]).to_numpy()
    values = pc.list_flatten(lists)
    flat = values.to_numpy(zero_copy_only=False).tolist() if len(values) else []
    return zip(
        valid.tolist(),
        (flat[start:end] for start, end in zip(offsets[:-1], offsets[1:], strict=True)),
        strict=True,
    )


def _mixed(column: pa.ChunkedArray) -> Any:
    """JSON text per value → Python values, typed as pandas infers them (``Int64``,
    ``boolean`` where they all are ints or bools)."""
    valid = np.flatnonzero(pc.is_valid(column).to_numpy(zero_copy_only=False))
    values = [json.loads(text) for text in column.drop_null().to_pylist()]
    series = pd.Series(values, index=valid, dtype=object if not values else None)
    if series.dtype.kind == "i":
        series = series.astype("Int64")
    elif series.dtype.kind == "b":
        series = series.astype("boolean")
    return series.reindex(range(len(column))).array
