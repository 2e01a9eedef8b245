"""A local-disk store: one file per object under a directory the user names.

Why one file per object rather than an append-only slab: a tier evicts objects one by one in
its policy's order, and with a file each, eviction is an ``unlink`` and a write is a temporary
file renamed into place, so a crash or a full disk never leaves a half-written object readable
and no compaction is needed. The price is one inode and one ``open`` per object, small beside
a chunk's hundreds of KiB.

Durability: none is promised (the tier is a cache; the server starts with an empty index and
removes the files it finds from an earlier run). ``fsync`` policy: never by default (the page
cache absorbs writes, as every peer's disk tier does); ``fsync=True`` syncs each file before
its rename, so a write's end means it reached the device.

Direct I/O: with ``direct_io=True`` files are opened with ``O_DIRECT`` where the filesystem
allows it (tmpfs, for one, does not: the store then says so in :attr:`DiskStore.direct_io`
and falls back to buffered I/O). Direct I/O bypasses the page cache, so read bandwidth is the
device's own instead of memory's; transfers go through a page-aligned buffer padded to 4 KiB,
and the file is truncated back to the object's length after the write.

Failures are answered, never raised (``server.tiers.base``): ``ENOSPC``/``EDQUOT`` are
``full``, any other ``OSError`` ``io_error``. Runs in the cache server's tier I/O thread.
"""

from __future__ import annotations

import errno
import mmap
import os
from collections.abc import Iterable
from pathlib import Path

from server.tiers.base import FailureCause
from testbed.core.keys import ChunkHash

_SUFFIX = ".kv"
_ALIGN = 4096
_FULL = {errno.ENOSPC, errno.EDQUOT}


class DiskStore:
    """Bytes under keys, one file ``<hex key>.kv`` each, in ``directory`` (made if absent)."""

    kind = "disk"

    def __init__(
        self,
        directory: Path,
        capacity_bytes: int,
        *,
        fsync: bool = False,
        direct_io: bool = False,
    ) -> None:
        self.directory = directory
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self.last_failure: FailureCause | None = None
        self._sizes: dict[ChunkHash, int] = {}
        self._used = 0
        directory.mkdir(parents=True, exist_ok=True)
        for stale in directory.glob("*" + _SUFFIX + "*"):
            stale.unlink(missing_ok=True)  # an earlier run's cache: its index is gone
        self.direct_io = direct_io and _direct_io_works(directory)

    # -- LowerTierStore ------------------------------------------------------------------------

    def used_bytes(self) -> int:
        return self._used

    def contains(self, key: ChunkHash) -> bool:
        return key in self._sizes

    def keys(self) -> Iterable[ChunkHash]:
        return list(self._sizes)

    def read(self, key: ChunkHash) -> bytes | None:
        size = self._sizes.get(key)
        if size is None:
            return None
        try:
            if self.direct_io:
                data = _read_direct(self._path(key), size)
            else:
                with open(self._path(key), "rb") as file:
                    data = file.read()
        except OSError as err:
            self._failed(err)
            return None
        if len(data) != size:
            self.last_failure = "corrupt"
            return None
        return data

    def write(self, key: ChunkHash, data: bytes) -> bool:
        path = self._path(key)
        temporary = path.with_suffix(_SUFFIX + ".tmp")
        try:
            if self.direct_io:
                _write_direct(temporary, data, self.fsync)
            else:
                with open(temporary, "wb") as file:
                    file.write(data)
                    if self.fsync:
                        file.flush()
                        os.fsync(file.fileno())
            os.replace(temporary, path)
        except OSError as err:
            temporary.unlink(missing_ok=True)
            self._failed(err)
            return False
        self._used += len(data) - self._sizes.get(key, 0)
        self._sizes[key] = len(data)
        return True

    def remove(self, key: ChunkHash) -> None:
        size = self._sizes.pop(key, None)
        if size is None:
            return
        self._used -= size
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError as err:
            self._failed(err)

    def close(self) -> None:
        for key in list(self._sizes):
            self.remove(key)

    # -- internal ------------------------------------------------------------------------------

    def _path(self, key: ChunkHash) -> Path:
        return self.directory / (key.hex() + _SUFFIX)

    def _failed(self, err: OSError) -> None:
        self.last_failure = "full" if err.errno in _FULL else "io_error"


def _direct_io_works(directory: Path) -> bool:
    """Whether ``O_DIRECT`` opens succeed on ``directory``'s filesystem."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    probe = directory / ("probe" + _SUFFIX + ".tmp")
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | flag, 0o600)
    except OSError:
        return False
    os.close(fd)
    probe.unlink(missing_ok=True)
    return True


def _padded(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN


def _write_direct(path: Path, data: bytes, fsync: bool) -> None:
    buffer = mmap.mmap(-1, max(_ALIGN, _padded(len(data))))  # page-aligned, as O_DIRECT needs
    try:
        buffer[: len(data)] = data
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_DIRECT, 0o600)
        try:
            os.write(fd, buffer)
            os.ftruncate(fd, len(data))  # the padding goes; the length is the object's
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        buffer.close()


def _read_direct(path: Path, size: int) -> bytes:
    buffer = mmap.mmap(-1, max(_ALIGN, _padded(size)))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            got = os.readv(fd, [buffer])
        finally:
            os.close(fd)
        return bytes(buffer[: min(got, size)])
    finally:
        buffer.close()
