"""The chunk event log: what happened to which chunk, in the order the server saw it.

Spans say what an operation did; they do not carry chunk identities (that would make them
huge). This log does, compactly: one row per chunk event, appended to
``RUN_DIR/chunks/server-<pid>.msgpack`` as a stream of MessagePack maps, each a *columnar
batch* ``{"columns": {name: [values, ...]}}`` of equal-length columns (:data:`COLUMNS`).
``testbed.analysis.chunklog`` reads it (and a run converts it to ``chunks.parquet``); the
miss causes of ``testbed.analysis.attribution`` and the what-if curves of
``testbed.analysis.whatif`` come from it. docs/telemetry.md documents the columns.

Rows are buffered and written in batches (at :data:`BATCH_ROWS` rows, at every housekeeping
tick and on close), so a row costs a few list appends on the request path.
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

import msgspec

from testbed.core.append_file import AppendFile

CHUNKS_DIR = "chunks"
COLUMNS = (
    "seq",
    "time_ns",
    "event",
    "chunk_hash",
    "kv_rank",
    "namespace",
    "session_id",
    "position",
    "status",
    "cause",
    "span_id",
    "nbytes",
)
BATCH_ROWS = 8192

# Events (the ``event`` column).
LOOKUP = "lookup"
RESERVE = "reserve"
COMMIT = "commit"
ABORT = "abort"
TOUCH = "touch"
EVICT = "evict"
DROP = "drop"


def namespace(model: str, world_size: int, cache_salt: str) -> str:
    """The ``namespace`` column: what, besides the chunk hash, names an object's key."""
    return f"{model}|{world_size}|{cache_salt}"


class NullChunkLog:
    """No run directory: nothing is recorded."""

    enabled = False
    rows = 0
    dropped_rows = 0
    pending_rows = 0

    def add(
        self,
        event: str,
        chunk_hash: bytes,
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
        self.path = directory / f"server-{os.getpid()}.msgpack"
        self._file = AppendFile(self.path, "chunk log rows")
        self._encoder = msgspec.msgpack.Encoder()
        self._columns: dict[str, list[object]] = {name: [] for name in COLUMNS}
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

    def add(
        self,
        event: str,
        chunk_hash: bytes,
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
        c = self._columns
        c["seq"].append(self.rows)
        c["time_ns"].append(time.time_ns())
        c["event"].append(event)
        c["chunk_hash"].append(chunk_hash)
        c["kv_rank"].append(kv_rank)
        c["namespace"].append(namespace)
        c["session_id"].append(session_id)
        c["position"].append(position)
        c["status"].append(status)
        c["cause"].append(cause)
        c["span_id"].append(span_id)
        c["nbytes"].append(nbytes)
        self.rows += 1
        if len(c["seq"]) >= BATCH_ROWS:
            self.flush()

    def flush(self) -> None:
        """Writes the buffered rows as one batch; never raises (``dropped_rows``)."""
        count = len(self._columns["seq"])
        if self._closed or not count:
            self._file.retry()
            return
        batch = self._encoder.encode({"columns": self._columns})
        self._columns = {name: [] for name in COLUMNS}
        if not self._file.append(batch, count):
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
