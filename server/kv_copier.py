"""Server-side copies between an engine's KV, mapped from shared memory, and the pool.

Runs in the cache server (``server`` transfer mode, LMCache's ``lmcache_driven`` on CPU). A
worker moved its KV tensors into a shared-memory file (``connector.shared_kv``) and
registered its :class:`~testbed.core.kv_layout.SharedKVFile`; the server maps that file and does a
store's or a retrieve's copies itself, with the same engine (``testbed.core.block_copy``) and in
the same object layout as the worker-side copy: an object stored in either mode retrieves
bit-exact in the other. No torch here (the base install has none): numpy views of the file.

Both directions take a whole operation, ``ChunkCopy(slot, block_ids, skip_blocks)`` per
chunk; a retrieve never writes a chunk's first ``skip_blocks`` blocks (the engine's own
prefix cache holds them, possibly shared with running requests).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
from collections.abc import Sequence

import numpy as np

from testbed.core import protocol as p
from testbed.core.block_copy import BlockCopier, ChunkCopy
from testbed.core.kv_layout import FILE_PREFIX, SharedKVFile

_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


class EngineKV:
    """One worker's shared KV file mapped into the server; context manager.

    A registration names a path, so only a regular file of this user named like
    ``connector.shared_kv`` names its files is opened (no symbolic link). The file is mapped
    with its pages populated, so copies take no page faults.
    """

    def __init__(self, shared: SharedKVFile, *, num_threads: int = 1) -> None:
        self.shared = shared
        if not os.path.basename(shared.path).startswith(FILE_PREFIX):
            raise ValueError(f"{shared.path} is not a shared KV file ({FILE_PREFIX}*)")
        fd = os.open(shared.path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            stats = os.fstat(fd)
            if not stat.S_ISREG(stats.st_mode) or stats.st_uid != os.getuid():
                raise ValueError(f"{shared.path} is not a regular file of this user")
            size = stats.st_size
            if size < shared.file_bytes:
                raise ValueError(
                    f"{shared.path} has {size} bytes, the registration says {shared.file_bytes}"
                )
            self._map = mmap.mmap(fd, shared.file_bytes, flags=mmap.MAP_SHARED | _MAP_POPULATE)
        finally:
            os.close(fd)
        self._array = np.frombuffer(self._map, dtype=np.uint8)
        layout = shared.layout
        self._copier = BlockCopier(
            layout, [self._array] * layout.num_layers, num_threads=num_threads
        )

    def begin(self, ready: p.CudaEvent | None) -> None:
        """CPU copies run inside the request's handler: there is nothing to order (the
        interface of ``server.cuda_engine.CudaEngineKV``, whose copies are asynchronous)."""
        if ready is not None:
            raise ValueError("a ready event orders copies of CUDA KV; this KV is in shared memory")

    def end(self) -> tuple[None, None]:
        """The copies are done when they return: no done event."""
        return None, None

    def store(self, pool: np.ndarray, copies: Sequence[ChunkCopy]) -> int:
        """Engine KV → pool: copies every chunk's blocks into its slot; returns bytes."""
        return self._copier.gather(pool, copies)

    def retrieve(self, pool: np.ndarray, copies: Sequence[ChunkCopy]) -> int:
        """Pool → engine KV, skipping each chunk's first ``skip_blocks``; returns bytes."""
        return self._copier.scatter(pool, copies)

    def close(self) -> None:
        self._copier.close()
        del self._copier, self._array
        with contextlib.suppress(BufferError):  # a view is still alive; it keeps the map
            self._map.close()

    def __enter__(self) -> EngineKV:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
