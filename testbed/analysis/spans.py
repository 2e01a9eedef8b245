"""Reading span files (OTLP JSON lines) of a run or a sweep into tidy pandas DataFrames.

Both loaders take a run directory (one with ``spans/``), a sweep directory, or any directory
of run directories (e.g. the ``--out`` of several ``kvtb run``): then every *complete* run
(with ``summary.json``; in ``sweep.json`` order for a sweep, by name otherwise) contributes
its rows, told apart by ``run_id``. :func:`run_dirs` says which directories those are.

:func:`load_spans` gives one row per span with the columns

``trace_id, span_id, parent_span_id`` (hex; ``""`` for roots), ``name, kind`` (``INTERNAL``,
``SERVER``, ``CLIENT``, ...), ``service, rank, run_id`` (the resource's ``kvcache.run_id``, else
the run directory's name), ``start_time`` (UTC timestamps), ``end_time, duration_ms, status``
(``UNSET``, ``OK``, ``ERROR``), ``status_message``, ``links`` (list of ``"trace_id:span_id"``),
``resource.<key>`` per other resource attribute (the process's: engine, workload, chunk size,
...), then one column per span attribute under its own name (``kvcache.tokens.hit``, ...; see
``testbed.core.telemetry.attributes``). ``kvcache.instance`` (a fleet's instance) is the span's,
else
its process's (a vLLM server of a fleet names its instance in its resource). Rows of a run are
in start-time order.

:func:`load_events` gives the span events (one per request of a batched store or retrieve),
with the ``run_id`` of the run directory they were read from.
The files are parsed by pyarrow's JSON reader and flattened with vectorised list kernels;
attributes are pivoted per key, not per value.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj

from testbed.core.telemetry import attributes as a
from testbed.core.telemetry.setup import SPANS_DIR

SUMMARY_FILE = "summary.json"  # written last by a run (testbed.run): a complete run
SWEEP_FILE = "sweep.json"  # a sweep's manifest (testbed.sweep.index): its run ids in order
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
_BLOCK_BYTES = 64 << 20  # larger than any line the exporter writes (one batch of spans)


def span_files(run_dir: Path | str) -> list[Path]:
    directory = Path(run_dir) / SPANS_DIR
    if not directory.is_dir():
        raise FileNotFoundError(
            f"{directory} does not exist: is {run_dir} a run directory (made by `kvtb run`)?"
        )
    return sorted(directory.glob("*.jsonl"))


def is_run_dir(path: Path | str) -> bool:
    return (Path(path) / SPANS_DIR).is_dir()


def run_dirs(path: Path | str) -> list[Path]:
    """``[path]`` for a run directory; the complete runs of a sweep directory (in the sweep's
    order) or of a directory of run directories (by name)."""
    path = Path(path)
    if is_run_dir(path):
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"{path} does not exist")
    manifest = path / SWEEP_FILE
    if manifest.is_file():
        candidates = [path / run_id for run_id in json.loads(manifest.read_text())["runs"]]
    else:
        candidates = sorted(child for child in path.iterdir() if child.is_dir())
    runs = [run for run in candidates if is_run_dir(run) and (run / SUMMARY_FILE).is_file()]
    if not runs and not manifest.is_file():
        raise FileNotFoundError(
            f"{path} is neither a run directory (no {SPANS_DIR}/) nor a directory of complete "
            "runs (made by `kvtb run` or `kvtb sweep`)"
        )
    return runs


def load_spans(path: Path | str) -> pd.DataFrame:
    """Every span of a run, a sweep or a directory of runs, one row each (see the module
    docstring for the columns)."""
    runs = run_dirs(path)
    parts = [(index, table) for index, run in enumerate(runs) for table in _tables(run)]
    try:
        # One table for all files: the per-attribute work below is then done once, not per file.
        tables = [pa.concat_tables([t for _, t in parts], promote_options="permissive")]
        line_runs = [np.concatenate([np.full(t.num_rows, index) for index, t in parts])]
    except (pa.ArrowInvalid, pa.ArrowTypeError, ValueError):  # none, or types that differ
        tables = [table for _, table in parts]
        line_runs = [np.full(table.num_rows, index) for index, table in parts]
    frames = [_spans_of(table, lines) for table, lines in zip(tables, line_runs, strict=True)]
    frames = [frame for frame in frames if len(frame)]
    if not frames:
        return pd.DataFrame(columns=BASE_COLUMNS)
    spans = frames[0] if len(frames) == 1 else pd.concat(frames, ignore_index=True, sort=False)
    run_index = spans.pop(_RUN_INDEX).to_numpy()
    names = np.array([run.name for run in runs], dtype=object)
    spans["run_id"] = spans["run_id"].fillna(pd.Series(names[run_index], index=spans.index))
    order = np.lexsort((spans["start_time"].to_numpy(), run_index))  # by run, then time
    spans = spans.take(order).reset_index(drop=True)
    # A span exported twice (to a span file and to a collector) counts once.
    duplicate = spans.duplicated(["run_id", "trace_id", "span_id"])
    return spans[~duplicate].reset_index(drop=True) if duplicate.any() else spans


def load_events(path: Path | str) -> pd.DataFrame:
    """Every span event: ``trace_id, span_id, span_name, event, time, run_id`` and its
    attributes (of a run, a sweep or a directory of runs, as :func:`load_spans`)."""
    frames = []
    for run in run_dirs(path):
        for table in _tables(run):
            frame = _events_of(table)
            if len(frame):
                frame.insert(5, "run_id", run.name)
                frames.append(frame)
    if not frames:
        return pd.DataFrame(columns=["trace_id", "span_id", "span_name", "event", "time", "run_id"])
    events = pd.concat(frames, ignore_index=True, sort=False)
    duplicate = events.duplicated(["run_id", "trace_id", "span_id", "event", "time"])
    return events[~duplicate].reset_index(drop=True) if duplicate.any() else events


def _tables(run_dir: Path | str) -> list[pa.Table]:
    tables = []
    for path in span_files(run_dir):
        if path.stat().st_size == 0:
            continue
        table = pj.read_json(path, read_options=pj.ReadOptions(block_size=_BLOCK_BYTES))
        tables.append(table)
    return tables


def _flatten(array: pa.Array) -> tuple[pa.Array, pa.Array]:
    """A list array's values and, for each value, the index of the list it came from."""
    array = _chunk(array)
    return pc.list_flatten(array), pc.list_parent_indices(array)


def _chunk(array: pa.Array | pa.ChunkedArray) -> pa.Array:
    return array.combine_chunks() if isinstance(array, pa.ChunkedArray) else array


def _field(struct: pa.StructArray, name: str) -> pa.Array | None:
    struct_type = struct.type
    if struct_type.get_field_index(name) < 0:
        return None
    return pc.struct_field(struct, name)


def _hierarchy(table: pa.Table) -> tuple[pa.StructArray, pa.StructArray, pa.Array, pa.Array]:
    """(resource spans, spans, index of each span's resource span, index of its file line)."""
    resource_spans, resource_line = _flatten(table.column("resourceSpans"))
    scope_spans, scope_parent = _flatten(pc.struct_field(resource_spans, "scopeSpans"))
    spans, span_parent = _flatten(pc.struct_field(scope_spans, "spans"))
    resource_index = pc.take(scope_parent, span_parent)
    return resource_spans, spans, resource_index, pc.take(resource_line, resource_index)


def _spans_of(table: pa.Table, line_runs: np.ndarray) -> pd.DataFrame:
    """The spans of ``table`` (lines of span files), each with the index in ``line_runs`` (one
    entry per line) of the run it came from as the ``_RUN_INDEX`` column."""
    resource_spans, spans, resource_index, line_index = _hierarchy(table)
    if len(spans) == 0:
        return pd.DataFrame()
    start = pc.cast(pc.struct_field(spans, "startTimeUnixNano"), pa.int64()).to_numpy()
    end = pc.cast(pc.struct_field(spans, "endTimeUnixNano"), pa.int64()).to_numpy()
    status = pc.struct_field(spans, "status")
    message = _field(status, "message")
    frame = pd.DataFrame(
        {
            "trace_id": pc.struct_field(spans, "traceId").to_numpy(zero_copy_only=False),
            "span_id": pc.struct_field(spans, "spanId").to_numpy(zero_copy_only=False),
            "parent_span_id": pc.fill_null(pc.struct_field(spans, "parentSpanId"), "").to_numpy(
                zero_copy_only=False
            ),
            "name": pc.struct_field(spans, "name").to_numpy(zero_copy_only=False),
            "kind": pd.Series(pc.struct_field(spans, "kind").to_numpy()).map(KINDS).to_numpy(),
            "start_time": pd.to_datetime(start, unit="ns", utc=True),
            "end_time": pd.to_datetime(end, unit="ns", utc=True),
            "duration_ms": (end - start) / 1e6,
            "status": pd.Series(pc.struct_field(status, "code").to_numpy())
            .map(STATUSES)
            .to_numpy(),
            "status_message": (
                pc.fill_null(message, "").to_numpy(zero_copy_only=False)
                if message is not None
                else ""
            ),
            "links": _links(spans),
        }
    )
    resources = _pivot(
        pc.struct_field(pc.struct_field(resource_spans, "resource"), "attributes"),
        len(resource_spans),
    )
    rows = resource_index.to_numpy()
    frame["service"] = _resource_column(resources, "service.name", rows)
    frame["run_id"] = _resource_column(resources, "kvcache.run_id", rows)
    frame["rank"] = _resource_column(resources, "kvcache.rank", rows)
    attributes = _pivot(pc.struct_field(spans, "attributes"), len(spans))
    if "kvcache.rank" in attributes:
        frame["rank"] = attributes.pop("kvcache.rank").combine_first(frame["rank"])
    frame["rank"] = pd.to_numeric(frame["rank"]).astype("Int64")
    for key, column in resources.items():
        if key not in ("service.name", "kvcache.run_id", "kvcache.rank"):
            frame[f"resource.{key}"] = column.array.take(rows)  # keeps nullable dtypes
    for key, column in attributes.items():
        frame[key] = column
    if f"resource.{a.INSTANCE}" in frame:  # a fleet's servers name their instance per process
        resource_instance = frame[f"resource.{a.INSTANCE}"]
        frame[a.INSTANCE] = (
            frame[a.INSTANCE].combine_first(resource_instance)
            if a.INSTANCE in frame
            else resource_instance
        )
    frame[_RUN_INDEX] = line_runs[line_index.to_numpy()]
    return frame[BASE_COLUMNS + [c for c in frame.columns if c not in BASE_COLUMNS]]


def _events_of(table: pa.Table) -> pd.DataFrame:
    _, spans, _, _ = _hierarchy(table)
    events_column = _field(spans, "events") if len(spans) else None
    if events_column is None:
        return pd.DataFrame()
    events, parent = _flatten(events_column)
    if len(events) == 0:
        return pd.DataFrame()
    time = pc.cast(pc.struct_field(events, "timeUnixNano"), pa.int64()).to_numpy()
    frame = pd.DataFrame(
        {
            "trace_id": pc.take(pc.struct_field(spans, "traceId"), parent).to_numpy(
                zero_copy_only=False
            ),
            "span_id": pc.take(pc.struct_field(spans, "spanId"), parent).to_numpy(
                zero_copy_only=False
            ),
            "span_name": pc.take(pc.struct_field(spans, "name"), parent).to_numpy(
                zero_copy_only=False
            ),
            "event": pc.struct_field(events, "name").to_numpy(zero_copy_only=False),
            "time": pd.to_datetime(time, unit="ns", utc=True),
        }
    )
    attributes_column = _field(events, "attributes")
    if attributes_column is not None:
        for key, column in _pivot(attributes_column, len(events)).items():
            frame[key] = column
    return frame


def _links(spans: pa.StructArray) -> list[list[str]]:
    links = _field(spans, "links")
    if links is None:
        return [[] for _ in range(len(spans))]
    flat, parent = _flatten(links)
    pairs = pc.binary_join_element_wise(
        pc.struct_field(flat, "traceId"), pc.struct_field(flat, "spanId"), ":"
    )
    result: list[list[str]] = [[] for _ in range(len(spans))]
    for index, pair in zip(parent.to_pylist(), pairs.to_pylist(), strict=True):
        result[index].append(pair)
    return result


def _pivot(attributes: pa.Array, num_rows: int) -> dict[str, pd.Series]:
    """OTLP key/value lists → one Series per key, indexed ``0..num_rows-1``."""
    flat, parent = _flatten(attributes)
    if len(flat) == 0:
        return {}
    keys = pc.struct_field(flat, "key")
    values = pc.struct_field(flat, "value")
    rows = parent.to_numpy()
    columns: dict[str, pd.Series] = {}
    for key in pc.unique(keys).to_pylist():
        mask = pc.equal(keys, key)
        key_rows = rows[mask.to_numpy(zero_copy_only=False)]
        series = pd.Series(_decode_values(pc.filter(values, mask)), index=key_rows)
        if series.dtype.kind == "i":
            series = series.astype("Int64")
        elif series.dtype.kind == "b":
            series = series.astype("boolean")
        columns[key] = series.reindex(range(num_rows))
    return columns


def _decode_values(values: pa.StructArray) -> Any:
    """The single typed column an attribute's values use (ints, floats, bools, strings, lists)."""
    for name, convert in (
        ("intValue", lambda a: pc.cast(a, pa.int64()).to_numpy(zero_copy_only=False)),
        ("doubleValue", lambda a: a.to_numpy(zero_copy_only=False)),
        ("boolValue", lambda a: a.to_numpy(zero_copy_only=False)),
        ("stringValue", lambda a: a.to_numpy(zero_copy_only=False)),
    ):
        column = _field(values, name)
        if column is not None and column.null_count == 0:
            return convert(column)
    array_values = _field(values, "arrayValue")
    if array_values is not None and array_values.null_count == 0:
        return [[_first_value(v) for v in row["values"] or []] for row in array_values.to_pylist()]
    return [_first_value(row) for row in values.to_pylist()]  # mixed types: rare


def _first_value(row: dict[str, Any] | None) -> Any:
    for name, value in (row or {}).items():
        if value is None:
            continue
        if name == "intValue":
            return int(value)
        if name == "arrayValue":
            return [_first_value(v) for v in value.get("values") or []]
        return value
    return None


def _resource_column(resources: dict[str, pd.Series], key: str, rows: Any) -> Any:
    if key not in resources:
        return None
    return resources[key].to_numpy()[rows]
