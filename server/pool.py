"""The server's memory pool: a shared-memory file the workers map, and its allocator.

The server owns the file (created in ``/dev/shm`` where it exists) and hands out
``(offset, nbytes)`` slots; the copies are made by the workers (``worker`` transfer mode) or
by the server itself through :attr:`SharedMemoryPool.array` (``server`` mode), so bulk bytes
never cross ZeroMQ. The allocator coalesces neighbouring free extents, so objects of several
sizes (different models or layouts on one server) do not fragment the pool for good.

Page faults. A fresh file has no pages: each first touch of a 4 KiB page costs a fault that
allocates and zeroes it (a 32 MiB copy into a cold pool took 3–5× as long as into a warm one
on the development machine). :meth:`prefault` allocates every page at start and maps it in
the server; workers then map the file with ``MAP_POPULATE`` (``connector.kv_copy.PoolMapping``;
a pool left lazy stays lazy there). Prefaulting commits the whole pool to memory at once: a
pool that does not fit fails at start, not with a ``SIGBUS`` in the middle of a copy, but a
pool sized far beyond what a run stores (an "unlimited" replay) should not be prefaulted.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import itertools
import mmap
import os
import secrets
import tempfile
import time
from pathlib import Path

import numpy as np

ALIGNMENT = 64
MADV_POPULATE_WRITE = 23
"""Linux ≥ 5.14: fault every page of a range in, writable (Python's mmap has no name for it)."""


def align(nbytes: int) -> int:
    """``nbytes`` rounded up to the pool's alignment (what an object really occupies)."""
    return (nbytes + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


class ExtentAllocator:
    """Best-fit allocator over ``[0, size)`` with exact-size reuse and coalescing.

    An allocation takes the smallest free extent that fits (exact sizes first, which is the
    common case: one object size per model), else grows the top. Free extents are indexed by
    start, by end (for coalescing) and by length; the distinct free lengths are kept sorted,
    so finding the best fit is a binary search, and an allocation or a free costs
    ``O(log n)`` comparisons in the number of free extents (plus the list insertion of a
    length not seen before, a ``memmove`` of pointers).
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._top = 0  # everything at or above the top is free
        self._free_at: dict[int, int] = {}  # offset -> length of a free extent below the top
        self._free_ending: dict[int, int] = {}  # end offset -> start offset
        self._by_length: dict[int, set[int]] = {}  # length -> offsets of free extents
        self._lengths: list[int] = []  # sorted keys of _by_length
        self._allocated: dict[int, int] = {}  # offset -> aligned length
        self._allocated_bytes = 0

    @property
    def allocated_bytes(self) -> int:
        return self._allocated_bytes

    @property
    def num_free_extents(self) -> int:
        """Free extents below the top (a measure of fragmentation)."""
        return len(self._free_at)

    def allocate(self, nbytes: int) -> int | None:
        """Offset of a new extent of ``nbytes`` (rounded up to 64), or ``None`` if none fits."""
        length = align(nbytes)
        offset = self._take_free(length)
        if offset is None and self._top + length <= self.size:
            offset = self._top
            self._top += length
        if offset is not None:
            self._allocated[offset] = length
            self._allocated_bytes += length
        return offset

    def free(self, offset: int) -> None:
        length = self._allocated.pop(offset)
        self._allocated_bytes -= length
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

    def check_invariants(self) -> None:
        """Asserts that the indices agree and that extents tile ``[0, top)`` (for tests)."""
        assert self._lengths == sorted(self._by_length)
        assert all(self._by_length.values())
        assert sorted(o for offsets in self._by_length.values() for o in offsets) == sorted(
            self._free_at
        )
        assert self._free_ending == {o + n: o for o, n in self._free_at.items()}
        assert self._allocated_bytes == sum(self._allocated.values())
        extents = sorted([*self._free_at.items(), *self._allocated.items()])
        cursor = 0
        for offset, length in extents:
            assert offset == cursor, f"gap or overlap at {cursor}"
            cursor += length
        assert cursor == self._top <= self.size
        free = sorted(self._free_at.items())
        assert all(a + n != b for (a, n), (b, _) in itertools.pairwise(free)), "uncoalesced"
        assert self._top not in self._free_ending, "a free extent below the top"

    def _take_free(self, length: int) -> int | None:
        position = bisect.bisect_left(self._lengths, length)
        if position == len(self._lengths):
            return None
        free_length = self._lengths[position]
        offset = self._by_length[free_length].pop()  # set.pop: amortised O(1)
        self._remove_free(offset)
        if free_length > length:
            self._add_free(offset + length, free_length - length)
        return offset

    def _add_free(self, offset: int, length: int) -> None:
        self._free_at[offset] = length
        self._free_ending[offset + length] = offset
        bucket = self._by_length.get(length)
        if bucket is None:
            bucket = self._by_length[length] = set()
            bisect.insort(self._lengths, length)
        bucket.add(offset)

    def _remove_free(self, offset: int) -> None:
        length = self._free_at.pop(offset)
        del self._free_ending[offset + length]
        bucket = self._by_length[length]
        bucket.discard(offset)
        if not bucket:
            del self._by_length[length]
            del self._lengths[bisect.bisect_left(self._lengths, length)]


class SharedMemoryPool:
    """A file of ``size`` bytes that workers map shared, mapped here too.

    Created in ``/dev/shm`` when it has room, else in the temporary directory; pages are
    allocated as they are first touched unless :meth:`prefault` is called. Context manager;
    :meth:`close` unmaps and removes the file.
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
            self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        except BaseException:
            self.path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        self.array: np.ndarray = np.frombuffer(self._map, dtype=np.uint8)
        """The whole pool as a writable flat uint8 array (the server-side copies' target)."""
        self._open = True

    def prefault(self) -> float:
        """Allocates every page of the pool and maps it here; returns the seconds it took.

        ``posix_fallocate`` reserves the pages (``OSError`` with ``ENOSPC`` if they do not
        fit), then ``MADV_POPULATE_WRITE`` maps them writable in one call; on kernels without
        it one byte per page is rewritten. Contents are unchanged, so it is safe at any time.
        """
        started = time.perf_counter()
        fd = os.open(self.path, os.O_RDWR)
        try:
            os.posix_fallocate(fd, 0, self.size)
        except OSError as exc:
            if exc.errno != errno.EOPNOTSUPP:  # a file system without it: pages fault below
                raise
        finally:
            os.close(fd)
        try:
            self._map.madvise(MADV_POPULATE_WRITE)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.ENOSYS):
                raise
            pages = self.array[:: mmap.PAGESIZE]
            pages[...] = pages.copy()
        return time.perf_counter() - started

    def resident_bytes(self) -> int:
        """Bytes of the file backed by memory now (allocated pages)."""
        return os.stat(self.path).st_blocks * 512

    def close(self) -> None:
        if self._open:
            self._open = False
            del self.array
            with contextlib.suppress(BufferError):  # a view is still alive; it keeps the map
                self._map.close()
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
