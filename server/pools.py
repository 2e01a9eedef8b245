"""The media the server's pool can live in, and how a pool of each medium is made.

Runs in the cache server. A pool is ``capacity_bytes`` of memory that objects are allocated in
(``server.pool.ExtentAllocator``); capacity, eviction, locks and ownership work the same
whatever its medium, since they act on slots, never on the memory. The media are a closed set
(:data:`testbed.core.protocol.PoolMedium`):

- ``shm``: a shared-memory file in ``/dev/shm`` (``server.pool.SharedMemoryPool``) that workers
  map; the default on a machine without a CUDA device;
- ``disk``: the same file in a directory on disk (``--pool-dir``), only when asked for;
- ``pinned-host``: the same file, page-locked with ``cudaHostRegister`` so the server's copies
  between it and CUDA KV are DMA transfers; workers can still map it (the default where a CUDA
  device is visible);
- ``gpu``: device memory on the server's GPU (``--pool-device``); only workers whose CUDA KV
  the server maps through CUDA IPC can use it (no worker can map device memory).

``pinned-host`` and ``gpu`` live in ``server.cuda_pools``, imported only when asked for: a
server with a ``shm`` or ``disk`` pool never imports torch.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from server.pool import SharedMemoryPool
from testbed.core.protocol import PoolMedium

NVIDIA_CONTROL_DEVICE = "/dev/nvidiactl"
"""Present where an NVIDIA driver is loaded: checked before importing torch to look for GPUs."""


class MemoryPool(Protocol):
    """What the service needs of a pool, whatever its medium."""

    @property
    def medium(self) -> PoolMedium: ...

    @property
    def size(self) -> int: ...

    @property
    def path(self) -> Path | None:
        """A file workers can map (``None``: no worker can)."""
        ...

    @property
    def array(self) -> np.ndarray | None:
        """The pool as a flat uint8 array, where host code can address it."""
        ...

    @property
    def tensor(self) -> Any:
        """The pool as a flat uint8 torch tensor, where CUDA copies can reach it."""
        ...

    def prefault(self) -> float: ...

    def close(self) -> None: ...


class FilePool(SharedMemoryPool):
    """A ``shm`` or ``disk`` pool: the shared file, nothing more."""

    tensor: Any = None


def default_pool_medium() -> PoolMedium:
    """``pinned-host`` where a CUDA device is visible, else ``shm`` (torch is imported only
    where an NVIDIA driver is loaded and torch is installed)."""
    if not os.path.exists(NVIDIA_CONTROL_DEVICE) or importlib.util.find_spec("torch") is None:
        return "shm"
    import torch

    return "pinned-host" if torch.cuda.is_available() else "shm"


def _shm(size: int, device: int, directory: Path | None) -> MemoryPool:
    return FilePool(size, "shm", directory)


def _disk(size: int, device: int, directory: Path | None) -> MemoryPool:
    return FilePool(size, "disk", directory)


def _need_torch(medium: str) -> None:
    if importlib.util.find_spec("torch") is None:
        raise ValueError(f"--pool {medium} needs torch with CUDA, which is not installed here")


def _pinned_host(size: int, device: int, directory: Path | None) -> MemoryPool:
    _need_torch("pinned-host")
    from server.cuda_pools import PinnedHostPool

    return PinnedHostPool(size)


def _gpu(size: int, device: int, directory: Path | None) -> MemoryPool:
    _need_torch("gpu")
    from server.cuda_pools import GpuPool

    return GpuPool(size, device)


POOLS: dict[PoolMedium, Callable[[int, int, Path | None], MemoryPool]] = {
    "shm": _shm,
    "disk": _disk,
    "pinned-host": _pinned_host,
    "gpu": _gpu,
}
"""Pool factories by medium: ``(size_bytes, device_index, directory) -> pool``."""


def make_pool(
    medium: PoolMedium | None, size: int, device: int = 0, directory: Path | None = None
) -> MemoryPool:
    """A pool of ``medium`` (``None``: :func:`default_pool_medium`); ``ValueError`` if this
    machine cannot hold one (no CUDA device for ``pinned-host`` or ``gpu``; ``directory`` for
    another medium than ``disk``), ``InsufficientSpace`` if the medium cannot hold it."""
    return POOLS[medium or default_pool_medium()](size, device, directory)
