"""A run's chunk event log: the server's per-chunk record of lookups, stores and evictions.

Every cache server writing to a run directory (``kvtb server --run-dir``) appends to
``<run_dir>/chunks/server-<pid>.msgpack``: a stream of msgpack maps, each one columnar batch
``{"columns": {name: [values, ...]}}`` whose lists have equal lengths. At the end of a run,
:func:`write_chunk_parquet` turns the streams into ``<run_dir>/chunks.parquet`` (dictionary
encoded, zstd; written a row group at a time, so converting a log of any length holds one
group in memory) and removes them; :func:`load_chunk_log` reads the Parquet file when there is
one, else the streams. Both give the same DataFrame, one row per event:

==============  ============  ====================================================================
column          dtype         meaning
==============  ============  ====================================================================
``server``      category      the stream the row came from (``server-<pid>``): ``seq`` orders rows
                              within one server process only
``seq``         int64         row order within the server process (the true order of events)
``time_ns``     int64         unix time in ns (server clock)
``event``       category      ``lookup`` ``reserve`` ``commit`` ``abort`` ``touch`` ``evict``
                              ``drop`` ``expire``
``chunk_hash``  object        the chunk's 16-byte prefix hash (``bytes``)
``kv_rank``     int16         the object's KV rank; -1 on lookup rows (chunk level, all ranks)
``namespace``   category      ``"{model}|{world_size}|{cache_salt}"``
``session_id``  category      ``"{engine_id}:{request_id}"``; ``""`` where none (e.g. evict)
``position``    int32         chunk index within the request (lookup, reserve, commit); else -1
``status``      category      lookup rows: ``hit`` ``in_flight`` ``absent``; else ``""``
``cause``       category      touch: ``store`` ``retrieve`` ``end_session``; evict: ``capacity``;
                              drop: ``drop``; else ``""``
``span_id``     category      hex id of the server span that caused the row
``nbytes``      int64         object bytes (0 on lookup rows)
==============  ============  ====================================================================

The columns and their neutral values are declared once, in ``testbed.core.chunk_events``
(the server writes them): a batch that lacks a column gets its neutral value (``""``, -1 for
``kv_rank`` and ``position``, 0 for ``nbytes``); columns the reader does not know are ignored.
A stream cut short (a server killed mid-write) loses only its unfinished last batch, with a
warning.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from testbed.core.chunk_events import COLUMN_NAMES, STREAM_SUFFIX, ChunkBatch
from testbed.core.chunk_events import COLUMNS as SCHEMA
from testbed.core.run_dir import CHUNKS, CHUNKS_DIR, RunDir

log = logging.getLogger(__name__)

CHUNK_PARQUET = CHUNKS  # testbed.core.run_dir's
ROW_GROUP_ROWS = 1 << 20
"""Rows of one row group of ``chunks.parquet`` (the most the conversion holds at once)."""
READ_BYTES = 1 << 22
"""Bytes of a stream read at a time (a window grows to hold a larger batch)."""

INT_COLUMNS: dict[str, tuple[str, int]] = {  # name -> (dtype, value when a batch lacks it)
    c.name: (c.kind, int(c.missing)) for c in SCHEMA if c.kind.startswith("int")
}
CATEGORY_COLUMNS = tuple(c.name for c in SCHEMA if c.kind == "category")
COLUMNS = ("server", *COLUMN_NAMES)
_MISSING = {c.name: c.missing for c in SCHEMA}

_batch_decoder = msgspec.msgpack.Decoder(ChunkBatch)
_raw_decoder = msgspec.msgpack.Decoder(msgspec.Raw)
_TRAILING = re.compile(r"trailing characters \(byte (\d+)\)")


def has_chunk_log(run_dir: Path | str) -> bool:
    """Whether a server wrote a chunk log into ``run_dir`` (Parquet or raw streams)."""
    run_dir = Path(run_dir)
    return RunDir(run_dir).chunks.is_file() or bool(_streams(run_dir))


def load_chunk_log(run_dir: Path | str) -> pd.DataFrame:
    """The run's chunk events (see the module docstring); ``FileNotFoundError`` without any."""
    run_dir = Path(run_dir)
    parquet = RunDir(run_dir).chunks
    if parquet.is_file():
        return _typed(pd.read_parquet(parquet))
    streams = _streams(run_dir)
    if not streams:
        raise FileNotFoundError(
            f"{run_dir} has no chunk log ({CHUNK_PARQUET} or {CHUNKS_DIR}/*{STREAM_SUFFIX}): "
            "was its cache server started with --run-dir pointing here?"
        )
    return _from_streams(streams)


def write_chunk_parquet(run_dir: Path | str, *, remove_raw: bool = True) -> tuple[int, int]:
    """Converts the raw streams of ``run_dir`` into ``chunks.parquet``; returns (rows, bytes of
    the file). Call it once every server writing to the run has stopped. ``(0, 0)`` and no
    file when no server wrote a stream. With ``remove_raw`` the streams are deleted once the
    Parquet file is in place."""
    run_dir = Path(run_dir)
    streams = _streams(run_dir)
    if not streams:
        return 0, 0
    target = RunDir(run_dir).chunks
    tmp = target.with_name(target.name + ".tmp")
    try:
        rows = _write_row_groups(streams, tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)  # e.g. a full disk: the raw streams stay
        raise
    tmp.replace(target)
    if remove_raw:
        for path in streams:
            path.unlink()
        directory = RunDir(run_dir).chunk_streams
        if not any(directory.iterdir()):
            directory.rmdir()
    return rows, target.stat().st_size


def _write_row_groups(streams: list[Path], path: Path) -> int:
    """Writes the streams' rows to ``path`` a row group of at most :data:`ROW_GROUP_ROWS` at a
    time (memory holds one group, whatever the log's length); returns the rows written."""
    schema = _parquet_schema()
    rows = 0
    with pq.ParquetWriter(path, schema, compression="zstd") as writer:
        for values in _row_groups(streams):
            frame = _frame(values)
            writer.write_table(pa.Table.from_pandas(frame, schema=schema, preserve_index=False))
            rows += len(frame)
    return rows


def _row_groups(streams: list[Path]) -> Iterator[dict[str, list[Any]]]:
    """The streams' rows, in order, as columns of about :data:`ROW_GROUP_ROWS` rows each."""
    values: dict[str, list[Any]] = {name: [] for name in COLUMNS}
    for path in streams:
        for batch in _batches(path):
            _append(values, batch.columns, path.stem)
            if len(values["server"]) >= ROW_GROUP_ROWS:
                yield values
                values = {name: [] for name in COLUMNS}
    if values["server"]:
        yield values


def _parquet_schema() -> pa.Schema:
    fields = []
    for name in COLUMNS:
        if name in INT_COLUMNS:
            fields.append(pa.field(name, pa.from_numpy_dtype(np.dtype(INT_COLUMNS[name][0]))))
        elif name == "chunk_hash":
            fields.append(pa.field(name, pa.binary()))
        else:
            fields.append(pa.field(name, pa.dictionary(pa.int32(), pa.string())))
    return pa.schema(fields)


def _streams(run_dir: Path) -> list[Path]:
    directory = RunDir(run_dir).chunk_streams
    return sorted(directory.glob(f"*{STREAM_SUFFIX}")) if directory.is_dir() else []


def _from_streams(paths: list[Path]) -> pd.DataFrame:
    values: dict[str, list[Any]] = {name: [] for name in COLUMNS}
    for path in paths:
        for batch in _batches(path):
            _append(values, batch.columns, path.stem)
    return _frame(values)


def _frame(values: dict[str, list[Any]]) -> pd.DataFrame:
    frame = pd.DataFrame(
        {
            "server": _categorical(values["server"]),
            **{
                name: np.asarray(values[name], dtype=dtype)
                for name, (dtype, _) in INT_COLUMNS.items()
            },
            **{name: _categorical(values[name]) for name in CATEGORY_COLUMNS},
            "chunk_hash": _objects(values["chunk_hash"]),
        }
    )
    return _typed(frame)


def _categorical(values: list[str]) -> pd.Categorical:
    """Strings as a categorical, factorized once (no intermediate string column)."""
    codes, uniques = pd.factorize(_objects(values))
    return pd.Categorical.from_codes(codes, pd.Index(uniques, dtype=object).astype(str))


def _objects(values: list[Any]) -> np.ndarray:
    array = np.empty(len(values), dtype=object)
    array[:] = values
    return array


def _batches(path: Path) -> Iterator[Any]:
    """The batches of one stream, read a window at a time (memory holds about one batch, not
    the stream). msgspec decodes exactly one object per call; the end of each map is found by
    a cheap untyped pass (``Raw`` skips without building objects), which also says when the
    window ends inside a map and must grow."""
    rows = 0
    with path.open("rb") as stream:
        window, position, offset, eof = b"", 0, 0, False
        while True:
            if position == len(window) and not eof:
                window, offset, position = stream.read(READ_BYTES), offset + position, 0
                eof = not window
            if position == len(window):
                return
            view = memoryview(window)[position:]
            try:
                end = _end_of_batch(view, eof)
            except msgspec.DecodeError as exc:
                log.warning(
                    "%s: unreadable data from byte %d on (%s); %d rows of batches before it kept",
                    path, offset + position, exc, rows,
                )  # fmt: skip
                return
            if end is None:  # the window ends inside this batch: read on
                more = stream.read(max(READ_BYTES, len(view)))
                window, offset, position = window[position:] + more, offset + position, 0
                eof = not more
                continue
            batch: Any = _batch_decoder.decode(view[:end])
            rows += len(batch.columns.seq or [])
            position += end
            yield batch


def _end_of_batch(view: memoryview, eof: bool) -> int | None:
    """Bytes of the map ``view`` begins with; ``None`` when ``view`` ends inside it and the
    stream has more; ``DecodeError`` when it is not a map's start or the stream ends inside it."""
    try:
        _raw_decoder.decode(view)
        return len(view)
    except msgspec.DecodeError as exc:
        match = _TRAILING.search(str(exc))
        if match is not None:
            return int(match.group(1))
        if not eof and "truncated" in str(exc):
            return None
        raise


def _append(values: dict[str, list[Any]], columns: Any, server: str) -> None:
    lengths = {
        len(getattr(columns, name))
        for name in COLUMNS[1:]
        if getattr(columns, name, None) is not None
    }
    if len(lengths) > 1:
        raise ValueError(f"chunk log batch of {server} has columns of different lengths {lengths}")
    num_rows = lengths.pop() if lengths else 0
    values["server"].extend([server] * num_rows)
    for name in COLUMNS[1:]:
        column = getattr(columns, name)
        if column is None:
            column = [_MISSING[name]] * num_rows
        values[name].extend(column)


def _typed(frame: pd.DataFrame) -> pd.DataFrame:
    """The dtypes of the module docstring, whichever source the frame came from."""
    frame = frame.reindex(columns=list(COLUMNS))
    for name, (dtype, default) in INT_COLUMNS.items():
        frame[name] = frame[name].fillna(default).astype(dtype)
    for name in ("server", *CATEGORY_COLUMNS):
        column = frame[name]
        if not isinstance(column.dtype, pd.CategoricalDtype):
            column = column.fillna("").astype(str).astype("category")
        frame[name] = column
    frame["chunk_hash"] = frame["chunk_hash"].astype(object)
    return frame
