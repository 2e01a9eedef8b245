"""The kinds of memory the server's pool can live in, and how a pool of each kind is made.

Runs in the cache server. A pool is ``capacity_bytes`` of memory that objects are allocated in
(``server.pool.ExtentAllocator``); capacity, eviction, locks and ownership work the same
whatever its kind, since they act on slots, never on the memory. The kinds are a closed set:

- ``cpu``: a shared-memory file (``server.pool.SharedMemoryPool``) that workers map; the
  default on a machine without a CUDA device;
- ``pinned-host``: the same file, page-locked with ``cudaHostRegister`` so the server's copies
  between it and CUDA KV are DMA transfers; workers can still map it (the default where a CUDA
  device is visible);
- ``gpu``: device memory on the server's GPU (``--pool-device``); only workers whose CUDA KV
  the server maps through CUDA IPC can use it (no worker can map device memory).

``pinned-host`` and ``gpu`` live in ``server.cuda_pools``, imported only when asked for: a
server with a ``cpu`` pool never imports torch.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

from server.pool import SharedMemoryPool

PoolKind = Literal["cpu", "pinned-host", "gpu"]
POOL_KINDS: tuple[PoolKind, ...] = ("cpu", "pinned-host", "gpu")

NVIDIA_CONTROL_DEVICE = "/dev/nvidiactl"
"""Present where an NVIDIA driver is loaded: checked before importing torch to look for GPUs."""


class MemoryPool(Protocol):
    """What the service needs of a pool, whatever its kind."""

    @property
    def kind(self) -> PoolKind: ...

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


class CpuPool(SharedMemoryPool):
    """A ``cpu`` pool: the shared-memory file, nothing more."""

    kind: PoolKind = "cpu"
    tensor: Any = None


def default_pool_kind() -> PoolKind:
    """``pinned-host`` where a CUDA device is visible, else ``cpu`` (torch is imported only
    where an NVIDIA driver is loaded and torch is installed)."""
    if not os.path.exists(NVIDIA_CONTROL_DEVICE) or importlib.util.find_spec("torch") is None:
        return "cpu"
    import torch

    return "pinned-host" if torch.cuda.is_available() else "cpu"


def _cpu(size: int, device: int) -> MemoryPool:
    return CpuPool(size)


def _need_torch(kind: str) -> None:
    if importlib.util.find_spec("torch") is None:
        raise ValueError(f"--pool {kind} needs torch with CUDA, which is not installed here")


def _pinned_host(size: int, device: int) -> MemoryPool:
    _need_torch("pinned-host")
    from server.cuda_pools import PinnedHostPool

    return PinnedHostPool(size)


def _gpu(size: int, device: int) -> MemoryPool:
    _need_torch("gpu")
    from server.cuda_pools import GpuPool

    return GpuPool(size, device)


POOLS: dict[PoolKind, Callable[[int, int], MemoryPool]] = {
    "cpu": _cpu,
    "pinned-host": _pinned_host,
    "gpu": _gpu,
}
"""Pool factories by kind: ``(size_bytes, device_index) -> pool``."""


def make_pool(kind: PoolKind | None, size: int, device: int = 0) -> MemoryPool:
    """A pool of ``kind`` (``None``: :func:`default_pool_kind`); ``ValueError`` if this machine
    cannot hold one (no CUDA device for ``pinned-host`` or ``gpu``)."""
    return POOLS[kind or default_pool_kind()](size, device)
