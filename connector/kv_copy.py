"""Copying KV blocks between a worker's paged KV tensors and slots of the shared pool.

Runs in each worker process (vLLM worker or the replay harness) in the ``worker`` transfer
mode. The object layout is ``testbed.core.kv_layout``'s: per layer in order, the chunk's blocks as
``layer.index_select(block_dim, block_ids)``, contiguous. A round trip is bit-exact whatever
the tensors' own strides, and the server-side copier (``server.kv_copier``) reads and writes
the very same objects.

One call copies a whole operation: :meth:`PagedKV.store_chunks` / :meth:`PagedKV.load_chunks`
take every chunk of a batch (``ChunkCopy(slot, block_ids, skip_blocks)``) and make one large
copy per chunk and buffer, not one per block and layer. CPU tensors are copied by
``testbed.core.block_copy`` through numpy views of their storage: single-threaded by default, the
GIL released, and independent of ``torch.set_num_threads``, which is process-wide and also
sizes vLLM's forward pass (see that module). CUDA tensors are copied by
``testbed.core.torch_block_copy`` (gathered on the device, one copy to or from the host pool per
group of slots), synchronously: the pool holds the bytes when a call returns. Server-driven,
CUDA KV is not copied here at all: the server maps it through CUDA IPC (``connector.cuda_ipc``).
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from testbed.core import protocol as p
from testbed.core.block_copy import BlockCopier, ChunkCopy, SlotLike
from testbed.core.kv_layout import PagedLayout
from testbed.core.torch_block_copy import TorchBlockCopier

PoolBuffer = np.ndarray | torch.Tensor
"""The pool as a flat uint8 numpy array or CPU tensor (``PoolMapping.array`` / ``.tensor``)."""


@dataclass(frozen=True)
class PagedKV:
    """A worker's KV caches: one tensor per layer, the block index on ``block_dim``.

    All layers share shape, strides, dtype and device; they may be separate tensors or views
    of one allocation (vLLM ≥ 0.21 allocates all layers in one buffer).
    """

    layers: tuple[torch.Tensor, ...]
    block_dim: int
    block_size: int
    num_copy_threads: int = 1
    """Threads of the CPU copy (this object's own pool; 1: the calling thread)."""
    _copier: list[tuple[int, BlockCopier]] = field(
        default_factory=list, init=False, repr=False, compare=False
    )
    _device_copier: list[TorchBlockCopier] = field(
        default_factory=list, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("no KV cache tensors to register")
        first = self.layers[0]
        for layer in self.layers:
            if (layer.shape, layer.stride(), layer.dtype, layer.device) != (
                first.shape,
                first.stride(),
                first.dtype,
                first.device,
            ):
                raise ValueError(
                    "all KV cache layers must share shape, strides, dtype and device "
                    f"({tuple(layer.shape)} {layer.stride()} {layer.dtype} {layer.device} vs "
                    f"{tuple(first.shape)} {first.stride()} {first.dtype} {first.device})"
                )
        if not 0 <= self.block_dim < first.dim():
            raise ValueError(f"block_dim {self.block_dim} outside a {first.dim()}-d KV tensor")

    @property
    def num_blocks(self) -> int:
        return self.layers[0].shape[self.block_dim]

    @property
    def layer_block_bytes(self) -> int:
        layer = self.layers[0]
        return layer.numel() // self.num_blocks * layer.element_size()

    @property
    def bytes_per_token(self) -> int:
        return self.layer_block_bytes * len(self.layers) // self.block_size

    def layout(self) -> p.KVLayout:
        dtype = str(self.layers[0].dtype).removeprefix("torch.")
        return p.KVLayout(
            num_layers=len(self.layers),
            block_size=self.block_size,
            bytes_per_token=self.bytes_per_token,
            dtype=dtype,
        )

    def paged_layout(self, layer_offsets_bytes: Sequence[int]) -> PagedLayout:
        """The tensors' geometry, with layer offsets counted in the caller's buffer(s)."""
        first = self.layers[0]
        size = first.element_size()
        return PagedLayout(
            layer_offsets_bytes=list(layer_offsets_bytes),
            shape=list(first.shape),
            strides_bytes=[stride * size for stride in first.stride()],
            dtype=str(first.dtype).removeprefix("torch."),
            itemsize=size,
            block_dim=self.block_dim,
            block_size=self.block_size,
        )

    # --- batched copies -------------------------------------------------------------------------

    def store_chunks(self, pool: PoolBuffer, copies: Sequence[ChunkCopy]) -> int:
        """Copies every chunk's blocks into its slot; returns the bytes written to the pool."""
        if self.layers[0].device.type != "cpu":
            return self._torch_copier().gather(_pool_tensor(pool), copies)
        return self._cpu_copier().gather(_pool_array(pool), copies)

    def load_chunks(self, pool: PoolBuffer, copies: Sequence[ChunkCopy]) -> int:
        """Copies every slot into its chunk's blocks, except each chunk's first
        ``skip_blocks`` (never written); returns the bytes written to the KV."""
        if self.layers[0].device.type != "cpu":
            return self._torch_copier().scatter(_pool_tensor(pool), copies)
        return self._cpu_copier().scatter(_pool_array(pool), copies)

    # --- one chunk (the worker client's calls) --------------------------------------------------

    def save(self, pool: PoolBuffer, slot: SlotLike, block_ids: list[int]) -> None:
        """Copies the blocks ``block_ids`` of every layer into ``slot``."""
        self.store_chunks(pool, [ChunkCopy(slot, block_ids)])

    def load(
        self, pool: PoolBuffer, slot: SlotLike, block_ids: list[int], skip_blocks: int = 0
    ) -> None:
        """Copies ``slot`` into the blocks ``block_ids``, except the first ``skip_blocks``."""
        self.load_chunks(pool, [ChunkCopy(slot, block_ids, skip_blocks)])

    def close(self) -> None:
        """Stops the copy threads, if any."""
        for _, copier in self._copier:
            copier.close()
        self._copier.clear()

    # --- internal -------------------------------------------------------------------------------

    def storage_views(self) -> tuple[list[int], list[torch.Tensor]]:
        """Per layer, its byte offset in its storage and that storage as a flat uint8 tensor
        on the layers' device (layers sharing a storage share one tensor)."""
        views: dict[int, torch.Tensor] = {}
        offsets, buffers = [], []
        for layer in self.layers:
            storage = layer.untyped_storage()
            key = storage.data_ptr()
            if key not in views:
                views[key] = torch.empty(0, dtype=torch.uint8, device=layer.device).set_(storage)
            buffers.append(views[key])
            offsets.append(int(layer.storage_offset()) * layer.element_size())
        return offsets, buffers

    def _cpu_copier(self) -> BlockCopier:
        """The numpy copier over the tensors' storages, rebuilt if a storage moved (e.g. into
        shared memory by ``connector.shared_kv``): numpy views hold raw addresses."""
        address = self.layers[0].untyped_storage().data_ptr()
        if self._copier and self._copier[0][0] == address:
            return self._copier[0][1]
        self.close()
        offsets, views = self.storage_views()
        arrays = {id(view): view.numpy() for view in views}
        copier = BlockCopier(
            self.paged_layout(offsets),
            [arrays[id(view)] for view in views],
            num_threads=self.num_copy_threads,
        )
        self._copier.append((address, copier))
        return copier

    def _torch_copier(self) -> TorchBlockCopier:
        """The torch copier over CUDA storages (which never move), made once."""
        if not self._device_copier:
            offsets, views = self.storage_views()
            copier = TorchBlockCopier(self.paged_layout(offsets), views, non_blocking=False)
            self._device_copier.append(copier)
        return self._device_copier[0]


def storage_array(storage: torch.UntypedStorage) -> np.ndarray:
    """A CPU storage's bytes as a writable 1-d uint8 numpy array (no copy)."""
    return torch.empty(0, dtype=torch.uint8).set_(storage).numpy()


def _pool_array(pool: PoolBuffer) -> np.ndarray:
    return pool.numpy() if isinstance(pool, torch.Tensor) else pool


def _pool_tensor(pool: PoolBuffer) -> torch.Tensor:
    return pool if isinstance(pool, torch.Tensor) else torch.from_numpy(pool)


class PoolMapping:
    """The server's pool file mapped into this process.

    When every page of the file is allocated (servers reserve their pool when they make it,
    ``server.pool``), the mapping is made with ``MAP_POPULATE``: all its pages are mapped now,
    so copies into the pool pay no page faults. A file with holes (an earlier server's lazy
    pool) stays lazy (``populated`` is False): populating would allocate it.
    """

    def __init__(self, path: str, size: int) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            self.populated = os.fstat(fd).st_blocks * 512 >= size and _MAP_POPULATE != 0
            flags = mmap.MAP_SHARED | (_MAP_POPULATE if self.populated else 0)
            self._map = mmap.mmap(fd, size, flags=flags)
        finally:
            os.close(fd)
        self.array: np.ndarray = np.frombuffer(self._map, dtype=np.uint8)
        self.tensor = torch.from_numpy(self.array)

    def close(self) -> None:
        del self.tensor
        del self.array
        with contextlib.suppress(BufferError):  # a view is still alive; it keeps the map
            self._map.close()


_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux only; elsewhere pages fault lazily
