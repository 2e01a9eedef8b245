"""The server's memory pool: a shared-memory file the workers map, and its allocator.

The server owns the file and hands out ``(offset, nbytes)`` slots; the copies are made by the
workers (``worker`` transfer mode) or by the server itself through
:attr:`SharedMemoryPool.array` (``server`` mode), so bulk bytes never cross ZeroMQ. The
allocator coalesces neighbouring free extents, so objects of several sizes (different models
or layouts on one server) do not fragment the pool for good.

Media. Where the pool lives is a closed set, :data:`testbed.core.protocol.PoolMedium`
(``server.pools`` makes a pool of each). The file here lives in one of two of them
(:data:`FileMedium`): ``shm`` (``/dev/shm``, the default) or ``disk`` (a directory, chosen
explicitly: copies then go through the page cache of a file system, and their times say so);
``pinned-host`` is the ``shm`` file page-locked. A pool never moves to another medium by
itself; the medium is recorded in the readiness line, the server's configuration reply and
every run summary (``pool_medium``).

Memory promised is there. The pool's bytes are reserved when it is created
(``testbed.core.owned_files.create_reserved``: ``posix_fallocate``, which on tmpfs allocates the
pages), so no copy into it can fault for want of memory later, whatever other processes do
to ``/dev/shm``; a pool that does not fit is refused at once, naming its size and what is
free. Its owner lock marks the file live for ``kvtb clean`` and other servers' reclaim.

Page tables. Reserved pages are still mapped on first touch (a minor fault each): a 32 MiB
copy into a pool not yet mapped took 3-5x as long as into a mapped one on the development
machine. :meth:`SharedMemoryPool.prefault` maps every page in the server, before it says it is
ready (every pool, whatever its size, unless ``--prefault`` caps it); workers map the file
with ``MAP_POPULATE`` (``connector.kv_copy.PoolMapping``).
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import itertools
import mmap
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import numpy as np

from testbed.core.owned_files import create_reserved, owned_name
from testbed.core.protocol import PoolMedium

FileMedium = Literal["shm", "disk"]
"""Where a pool file lives: ``/dev/shm`` or a directory on disk."""

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
    """A file of ``size`` bytes, reserved, that workers map shared, mapped here too.

    In ``/dev/shm`` (``medium="shm"``) or in ``directory`` (``medium="disk"``, default: the
    temporary directory). Raises ``testbed.core.owned_files.InsufficientSpace`` when the medium
    cannot hold it. Context manager; :meth:`close` unmaps and removes the file.
    """

    def __init__(
        self, size: int, medium: FileMedium = "shm", directory: Path | None = None
    ) -> None:
        if size <= 0:
            raise ValueError(f"pool size must be positive, got {size}")
        self.medium: PoolMedium = medium
        directory = pool_directory(medium, directory)
        self.path = directory / owned_name("kvtb-pool-")
        self.size = size
        self._owner = create_reserved(
            self.path, size, what=f"a {medium} cache pool", hint=_HINTS[medium]
        )
        try:
            self._map = mmap.mmap(self._owner.fd, size, flags=mmap.MAP_SHARED)
        except BaseException:
            self._owner.close()
            self.path.unlink(missing_ok=True)
            raise
        self.array: np.ndarray = np.frombuffer(self._map, dtype=np.uint8)
        """The whole pool as a writable flat uint8 array (the server-side copies' target)."""
        self._open = True

    def prefault(self) -> float:
        """Maps every page of the (reserved) pool here; returns the seconds it took.

        ``MADV_POPULATE_WRITE`` maps them writable in one call; on kernels without it one
        byte per page is rewritten. Contents are unchanged, so it is safe at any time.
        """
        started = time.perf_counter()
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
            self._owner.close()

    def __enter__(self) -> SharedMemoryPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


SHM_DIR = Path("/dev/shm")

_HINTS: dict[FileMedium, str] = {
    "shm": "lower --capacity, free /dev/shm, or put the pool on disk explicitly with "
    "--pool disk (copy times then measure a disk-backed pool)",
    "disk": "lower --capacity or free space there (--pool-dir picks another directory)",
}


def pool_directory(medium: FileMedium, directory: Path | None = None) -> Path:
    """Where a pool of ``medium`` goes: ``/dev/shm``, or ``directory`` (default: the temporary
    directory) for ``disk``; ``ValueError`` when the medium is not there."""
    return _DIRECTORIES[medium](directory)


def _shm_directory(directory: Path | None) -> Path:
    if directory is not None:
        raise ValueError("--pool-dir goes with --pool disk (a shm pool is in /dev/shm)")
    if not SHM_DIR.is_dir():
        raise ValueError(
            f"{SHM_DIR} does not exist here; put the pool on disk explicitly with --pool disk"
        )
    return SHM_DIR


def _disk_directory(directory: Path | None) -> Path:
    chosen = Path(directory) if directory is not None else Path(tempfile.gettempdir())
    if not chosen.is_dir():
        raise ValueError(f"--pool-dir {chosen} is not a directory")
    return chosen


_DIRECTORIES: dict[FileMedium, Callable[[Path | None], Path]] = {
    "shm": _shm_directory,
    "disk": _disk_directory,
}
