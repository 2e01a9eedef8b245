"""Appending whole records to a file that may fill up: the writer never fails, nothing is torn.

Used by the span files (``testbed.core.telemetry.otlp_json``) and the server's chunk log
(``server.chunk_log``), in whichever process writes them. A record (a line of spans, a batch
of chunk events) is written whole or not at all: after a failed write (a full disk, an I/O
error) the file is cut back to its last complete record, so readers never see half of one.
A record that cannot be written is kept in memory, up to ``max_pending_bytes``, and written
before the next one, so a disk that fills for a while (or until a run frees the space it
reserved for its results) loses nothing; beyond the bound, and whatever is still pending when
the file is closed, is lost and counted (:attr:`AppendFile.lost_items`). The first failure of
a spell is logged, and the recovery, never every record.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections import deque
from pathlib import Path

log = logging.getLogger(__name__)

MAX_PENDING_BYTES = 64 << 20
"""Records kept in memory while their file cannot be written (per file), by default."""
PENDING_BYTES_ENV = "KVTB_TELEMETRY_PENDING_BYTES"
"""Environment variable: that bound, in bytes, for every span file and chunk log of the
process (0: a record that cannot be written at once is lost, and counted)."""


def pending_bytes_setting() -> int:
    """:data:`PENDING_BYTES_ENV` if set (a byte count), else :data:`MAX_PENDING_BYTES`."""
    value = os.environ.get(PENDING_BYTES_ENV, "").strip()
    try:
        return max(0, int(value)) if value else MAX_PENDING_BYTES
    except ValueError:
        raise ValueError(f"{PENDING_BYTES_ENV}={value!r} is not a number of bytes") from None


class AppendFile:
    """Records appended to ``path`` (created if missing); ``what`` names them in log lines."""

    def __init__(self, path: Path, what: str, max_pending_bytes: int | None = None) -> None:
        self.path = Path(path)
        self.what = what
        self.max_pending_bytes = (
            max_pending_bytes if max_pending_bytes is not None else pending_bytes_setting()
        )
        self._fd: int | None = os.open(
            self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644
        )
        self._size = os.fstat(self._fd).st_size
        self._pending: deque[tuple[bytes, int]] = deque()
        self._pending_bytes = 0
        self.lost_items = 0
        """Items of records accepted (kept for later) and then never written."""
        self.first_error: str | None = None
        """Why a write failed, the first time (``None``: never)."""

    @property
    def pending_items(self) -> int:
        return sum(items for _, items in self._pending)

    def append(self, record: bytes, items: int) -> bool:
        """Writes ``record`` (holding ``items`` items) after any pending ones; False when it
        could neither be written nor kept (the caller counts those items as dropped)."""
        if self._fd is None:
            return False
        if self.retry() and self._write(record):
            return True
        if self._pending_bytes + len(record) > self.max_pending_bytes:
            return False
        self._pending.append((record, items))
        self._pending_bytes += len(record)
        return True

    def retry(self) -> bool:
        """Writes pending records in order; True when none is left."""
        while self._pending:
            record, items = self._pending[0]
            if not self._write(record):
                return False
            self._pending.popleft()
            self._pending_bytes -= len(record)
        return True

    def close(self) -> None:
        """Writes what it can of the pending records, counts the rest lost, closes."""
        if self._fd is None:
            return
        self.retry()
        self.lost_items += self.pending_items
        self._pending.clear()
        self._pending_bytes = 0
        os.close(self._fd)
        self._fd = None

    def _write(self, record: bytes) -> bool:
        assert self._fd is not None
        failing = self.first_error is not None and bool(self._pending)
        try:
            written = os.write(self._fd, record)
            if written != len(record):
                raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (short write)")
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._size)  # no torn record in the file
            if not failing:
                self.first_error = self.first_error or str(exc)
                log.warning(
                    "cannot write %s to %s (%s): kept in memory (up to %d bytes) and written "
                    "when it can be, else counted as lost; this process goes on",
                    self.what,
                    self.path,
                    exc,
                    self.max_pending_bytes,
                )
            return False
        self._size += written
        if failing:
            log.warning("%s are written to %s again", self.what, self.path)
        return True
