"""The chunk event log: what happened to which chunk, in the order the server saw it.

Spans say what an operation did; they do not carry chunk identities (that would make them
huge). This log does, compactly: one row per chunk event, appended to
``RUN_DIR/chunks/server-<pid>.msgpack`` in the columnar batches of the chunk-event schema
(``testbed.core.chunk_events``, which ``testbed.analysis.chunklog`` reads; a run converts the
streams to ``chunks.parquet``). The miss causes of ``testbed.analysis.attribution`` and the
what-if curves of ``testbed.analysis.whatif`` come from it.

Rows are buffered and written in batches (at :data:`BATCH_ROWS` rows, at every housekeeping
tick and on close), so a row costs a tuple and an append on the request path.
:class:`NullChunkLog` stands in when the server has no run directory.

A batch that cannot be written (a full disk, an I/O error) is dropped whole and counted
(:attr:`ChunkLog.dropped_rows`, the server's ``chunk_events_dropped``): the file is cut back to
its last complete batch, so it stays readable, and the server goes on serving. The first
failure is logged (and the first success after failures), not every batch.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TypedDict, Unpack

import msgspec

from server.objects import ObjectKey
from testbed.core.append_file import AppendFile
from testbed.core.chunk_events import CHUNKS_DIR, COLUMN_NAMES, STREAM_SUFFIX, Event, namespace
from testbed.core.keys import ChunkHash

BATCH_ROWS = 8192

_Row = tuple[str, bytes, int, str, str, int, str, str, str, int]
"""A row without its ``seq`` and ``time_ns``: the columns from ``event`` on."""


class ObjectColumns(TypedDict, total=False):
    """The columns of a row about one object beside its key's (:meth:`NullChunkLog.add_object`)."""

    session_id: str
    position: int
    status: str
    cause: str
    span_id: str
    nbytes: int


class NullChunkLog:
    """No run directory: nothing is recorded. :meth:`add` is the one way to record an event;
    subclasses keep its rows (:meth:`_record`)."""

    enabled = False
    rows = 0
    dropped_rows = 0
    pending_rows = 0

    def add(
        self,
        event: Event,
        chunk_hash: ChunkHash,
        *,
        kv_rank: int = -1,
        namespace: str = "",
        session_id: str = "",
        position: int = -1,
        status: str = "",
        cause: str = "",
        span_id: str = "",
        nbytes: int = 0,
    ) -> None:
        """Records one event (the columns of ``testbed.core.chunk_events``; the defaults are
        the schema's values for "not applicable")."""
        self._record(
            (event, chunk_hash, kv_rank, namespace, session_id, position, status, cause,
             span_id, nbytes)
        )  # fmt: skip

    def add_object(self, event: Event, key: ObjectKey, **columns: Unpack[ObjectColumns]) -> None:
        """Records one event about the object ``key`` names: its chunk, rank and namespace."""
        self.add(
            event,
            key.chunk_hash,
            kv_rank=key.kv_rank,
            namespace=namespace(key.model, key.world_size, key.cache_salt),
            **columns,
        )

    def _record(self, row: _Row) -> None:
        return None

    def flush(self) -> None:
        return None

    def close(self) -> None:
        return None


class ChunkLog(NullChunkLog):
    """Appends rows to ``run_dir/chunks/server-<pid>.msgpack``. Context manager."""

    enabled = True

    def __init__(self, run_dir: Path) -> None:
        directory = Path(run_dir) / CHUNKS_DIR
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"server-{os.getpid()}{STREAM_SUFFIX}"
        self._file = AppendFile(self.path, "chunk log rows")
        self._encoder = msgspec.msgpack.Encoder()
        self._rows: list[tuple[object, ...]] = []
        self.rows = 0
        self._rejected = 0
        self._closed = False

    @property
    def dropped_rows(self) -> int:  # type: ignore[override]
        """Rows that could not be written: refused while the file could not take them and
        too many were pending, or still pending when the log was closed."""
        return self._rejected + self._file.lost_items

    @property
    def pending_rows(self) -> int:  # type: ignore[override]
        """Rows not written yet, kept until the file takes them."""
        return self._file.pending_items

    def _record(self, row: _Row) -> None:
        self._rows.append((self.rows, time.time_ns(), *row))
        self.rows += 1
        if len(self._rows) >= BATCH_ROWS:
            self.flush()

    def flush(self) -> None:
        """Writes the buffered rows as one batch; never raises (``dropped_rows``)."""
        count = len(self._rows)
        if self._closed or not count:
            self._file.retry()
            return
        columns = dict(zip(COLUMN_NAMES, map(list, zip(*self._rows, strict=True)), strict=True))
        self._rows = []
        if not self._file.append(self._encoder.encode({"columns": columns}), count):
            self._rejected += count

    def close(self) -> None:
        if not self._closed:
            self.flush()
            self._file.close()
            self._closed = True

    def __enter__(self) -> ChunkLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
