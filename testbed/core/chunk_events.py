"""The chunk-event schema: the columns the cache server writes and analysis reads.

The server (``server.chunk_log``) appends one row per chunk event to
``RUN_DIR/chunks/server-<pid>.msgpack``, a stream of MessagePack maps, each a *columnar
batch* ``{"columns": {name: [values, ...]}}`` of equal-length lists in the order of
:data:`COLUMNS`; ``testbed.analysis.chunklog`` decodes the batches with :data:`ChunkBatch`
and types them as :class:`Column` says. docs/telemetry.md describes every column.

A reader gives a column a batch lacks its :attr:`Column.missing` value, and ignores columns it
does not know, so the schema can grow without breaking old runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import msgspec

from testbed.core.run_dir import CHUNKS_DIR as CHUNKS_DIR  # the servers' streams' directory

STREAM_SUFFIX = ".msgpack"

ColumnKind = Literal["int64", "int32", "int16", "category", "bytes"]


@dataclass(frozen=True)
class Column:
    """One column: its name, how analysis types it, the value of a row that has none."""

    name: str
    kind: ColumnKind
    missing: int | str | bytes
    """The server's value for "not applicable" (``kv_rank`` on a lookup row...) and the
    reader's for a batch that lacks the column."""

    @property
    def python_type(self) -> type:
        if self.kind == "category":
            return str
        return bytes if self.kind == "bytes" else int


COLUMNS: tuple[Column, ...] = (
    Column("seq", "int64", 0),
    Column("time_ns", "int64", 0),
    Column("event", "category", ""),
    Column("chunk_hash", "bytes", b""),
    Column("kv_rank", "int16", -1),
    Column("namespace", "category", ""),
    Column("session_id", "category", ""),
    Column("position", "int32", -1),
    Column("status", "category", ""),
    Column("cause", "category", ""),
    Column("span_id", "category", ""),
    Column("nbytes", "int64", 0),
)
"""Every column, in the order the server writes them."""
COLUMN_NAMES: tuple[str, ...] = tuple(column.name for column in COLUMNS)

ChunkColumns = msgspec.defstruct(
    "ChunkColumns",
    [(c.name, list[c.python_type] | None, None) for c in COLUMNS],  # type: ignore[name-defined]
)
"""One batch's columns as the reader decodes them (``None``: the batch lacks the column)."""
ChunkBatch = msgspec.defstruct("ChunkBatch", [("columns", ChunkColumns)])

Event = Literal["lookup", "reserve", "commit", "abort", "touch", "evict", "drop"]
"""The ``event`` column."""
LOOKUP: Event = "lookup"
RESERVE: Event = "reserve"
COMMIT: Event = "commit"
ABORT: Event = "abort"
TOUCH: Event = "touch"
EVICT: Event = "evict"
DROP: Event = "drop"


def namespace(model: str, world_size: int, cache_salt: str) -> str:
    """The ``namespace`` column: what, besides the chunk hash, names an object's key."""
    return f"{model}|{world_size}|{cache_salt}"
