"""Pools the server's CUDA copies reach: page-locked host memory, and GPU memory.

Runs in the cache server, imported only for ``--pool pinned-host`` or ``--pool gpu`` (see
``server.pools``). Both expose the pool as one flat uint8 torch tensor (:attr:`tensor`) that
``server.cuda_engine`` copies to and from; allocation, capacity and eviction are the same as
for a ``shm`` pool (``server.pool.ExtentAllocator`` over ``[0, size)``).
"""

from __future__ import annotations

import torch

from server.pool import SharedMemoryPool
from testbed.core.protocol import PoolMedium

CUDA_HOST_REGISTER_PORTABLE = 1
"""``cudaHostRegisterPortable``: the pages count as pinned for every device's context."""


def _need_cuda(flag: str) -> None:
    if not torch.cuda.is_available():
        raise ValueError(
            f"--pool {flag} needs a CUDA device, and this machine shows none to torch "
            "(use --pool shm)"
        )


class PinnedHostPool(SharedMemoryPool):
    """The shared-memory file, page-locked (``cudaHostRegister``): copies between it and a
    GPU are DMA transfers, asynchronous to the host. Registering faults every page in, so the
    whole pool is committed to memory at start (a pool that does not fit fails then)."""

    def __init__(self, size: int) -> None:
        _need_cuda("pinned-host")
        super().__init__(size)
        self.medium: PoolMedium = "pinned-host"
        self.tensor: torch.Tensor | None = torch.from_numpy(self.array)
        address = self.tensor.data_ptr()
        error = torch.cuda.cudart().cudaHostRegister(address, size, CUDA_HOST_REGISTER_PORTABLE)
        if int(error) != 0:
            self.tensor = None
            super().close()
            raise ValueError(
                f"cannot page-lock a {size}-byte pool (cudaHostRegister error {int(error)}): "
                "lower --capacity, or use --pool shm"
            )
        self._address: int | None = address

    def close(self) -> None:
        if self._address is not None:
            torch.cuda.cudart().cudaHostUnregister(self._address)
            self._address = None
        self.tensor = None
        super().close()


class GpuPool:
    """``size`` bytes of memory on GPU ``device``; no file (workers cannot map it)."""

    medium: PoolMedium = "gpu"
    path = None
    array = None

    def __init__(self, size: int, device: int) -> None:
        _need_cuda("gpu")
        if not 0 <= device < torch.cuda.device_count():
            raise ValueError(
                f"--pool-device {device}: this machine has {torch.cuda.device_count()} GPUs"
            )
        if size <= 0:
            raise ValueError(f"pool size must be positive, got {size}")
        self.size = size
        self.device = torch.device("cuda", device)
        try:
            self.tensor: torch.Tensor | None = torch.empty(
                size, dtype=torch.uint8, device=self.device
            )
        except torch.cuda.OutOfMemoryError:
            raise ValueError(
                f"GPU {device} cannot hold a {size}-byte pool: lower --capacity"
            ) from None

    def prefault(self) -> float:
        """Device memory is resident once allocated."""
        return 0.0

    def close(self) -> None:
        self.tensor = None

    def __enter__(self) -> GpuPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
