"""The server's memory pool: a shared-memory file the workers map, and its allocator.

The server owns the file (created in ``/dev/shm`` where it exists) and only hands out
``(offset, nbytes)`` slots; workers copy KV bytes in and out themselves, so bulk bytes never
cross ZeroMQ. The allocator coalesces neighbouring free extents, so objects of several sizes
(different models or layouts on one server) do not fragment the pool for good.
"""

from __future__ import annotations

import os
import secrets
import tempfile
from pathlib import Path

ALIGNMENT = 64


def align(nbytes: int) -> int:
    """``nbytes`` rounded up to the pool's alignment (what an object really occupies)."""
    return (nbytes + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


class ExtentAllocator:
    """First-fit allocator over ``[0, size)`` with exact-size reuse and coalescing."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._top = 0  # everything at or above the top is free
        self._free_at: dict[int, int] = {}  # offset -> length of a free extent below the top
        self._free_ending: dict[int, int] = {}  # end offset -> start offset
        self._by_length: dict[int, set[int]] = {}
        self._allocated: dict[int, int] = {}  # offset -> aligned length

    @property
    def allocated_bytes(self) -> int:
        return sum(self._allocated.values())

    def allocate(self, nbytes: int) -> int | None:
        """Offset of a new extent of ``nbytes`` (rounded up to 64), or ``None`` if none fits."""
        length = align(nbytes)
        offset = self._take_free(length)
        if offset is None and self._top + length <= self.size:
            offset = self._top
            self._top += length
        if offset is not None:
            self._allocated[offset] = length
        return offset

    def free(self, offset: int) -> None:
        length = self._allocated.pop(offset)
        start, end = offset, offset + length
        before = self._free_ending.get(start)
        if before is not None:
            start = before
            self._remove_free(before)
        if end in self._free_at:
            after_length = self._free_at[end]
            self._remove_free(end)
            end += after_length
        if end == self._top:
            self._top = start
        else:
            self._add_free(start, end - start)

    def _take_free(self, length: int) -> int | None:
        exact = self._by_length.get(length)
        if exact:
            offset = next(iter(exact))
            self._remove_free(offset)
            return offset
        for free_length in sorted(self._by_length):
            if free_length > length and self._by_length[free_length]:
                offset = next(iter(self._by_length[free_length]))
                self._remove_free(offset)
                self._add_free(offset + length, free_length - length)
                return offset
        return None

    def _add_free(self, offset: int, length: int) -> None:
        self._free_at[offset] = length
        self._free_ending[offset + length] = offset
        self._by_length.setdefault(length, set()).add(offset)

    def _remove_free(self, offset: int) -> None:
        length = self._free_at.pop(offset)
        del self._free_ending[offset + length]
        bucket = self._by_length[length]
        bucket.discard(offset)
        if not bucket:
            del self._by_length[length]


class SharedMemoryPool:
    """A file of ``size`` bytes that workers map shared; the server only hands out slots.

    Created in ``/dev/shm`` when it has room (pages are allocated as workers touch them),
    else in the temporary directory. Context manager; :meth:`close` removes the file.
    """

    def __init__(self, size: int) -> None:
        if size <= 0:
            raise ValueError(f"pool size must be positive, got {size}")
        directory = _pool_directory(size)
        self.path = directory / f"kvtb-pool-{os.getpid()}-{secrets.token_hex(4)}"
        self.size = size
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        self._open = True

    def close(self) -> None:
        if self._open:
            self._open = False
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> SharedMemoryPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pool_directory(size: int) -> Path:
    shm = Path("/dev/shm")
    if shm.is_dir():
        stats = os.statvfs(shm)
        if stats.f_bavail * stats.f_frsize >= size:
            return shm
    return Path(tempfile.gettempdir())
