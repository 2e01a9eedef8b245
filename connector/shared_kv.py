"""Moving a worker's KV tensors into a shared-memory file, in place, for the server to map.

Runs in each worker process, once, when vLLM registers its KV caches (``server`` transfer
mode, LMCache's ``lmcache_driven`` on CPU). vLLM keeps using the tensors it already holds:
the registered ones *and* every view made of them before registration (vLLM 0.32 binds the
attention layers to views of one allocation, e.g. kernel-block or MLA views). So the bytes are
moved under the tensors, not the tensors replaced:

1. one file in ``/dev/shm`` (else the temporary directory) holds every distinct storage of
   the layers, each at a page-aligned offset; its bytes are reserved when it is made (a file
   that does not fit is refused, never a ``SIGBUS`` mid-copy) and the worker holds its owner
   lock (``testbed.core.owned_files``); the file is mapped shared and the storages' bytes are
   copied in;
2. each storage then swaps its data pointer with a storage over its part of the mapping
   (``UntypedStorage._swap_data_ptr_``): every tensor and view of that storage keeps its
   shape, strides, dtype and contents and now reads and writes the file. The old memory is
   freed. (Where torch lacks the swap, or with ``method="set"``, each registered tensor is
   ``set_`` onto the new storage instead; views made earlier would keep the old memory.)
   Tensors follow; raw pointers taken before do not: a numpy array made earlier from one of
   the tensors (``tensor.numpy()``) still points at the freed allocation, so make such
   arrays after registration.

:attr:`SharedKV.description` (a :class:`testbed.core.kv_layout.SharedKVFile`) is what a
registration message carries: the server maps the file with numpy (``server.kv_copier``) and
copies blocks itself, in the pool object layout of ``connector.kv_copy``. The mapping lives
as long as the tensors do; :meth:`SharedKV.close` only removes the file's name (the server
keeps its own mapping until it drops the worker). CPU tensors only: CUDA KV will be shared
through CUDA IPC.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from connector.kv_copy import PagedKV, storage_array
from testbed.core.closing import Closing
from testbed.core.kv_layout import FILE_PREFIX, SharedKVFile
from testbed.core.owned_files import create_reserved, owned_name

_ALIGNMENT = mmap.PAGESIZE


class SharedKV(Closing):
    """The KV tensors ``layers`` moved into a shared-memory file; context manager."""

    def __init__(
        self,
        layers: Sequence[torch.Tensor],
        block_dim: int,
        block_size: int,
        *,
        directory: Path | None = None,
        method: Literal["swap", "set"] = "swap",
    ) -> None:
        kv = PagedKV(tuple(layers), block_dim, block_size)
        if kv.layers[0].device.type != "cpu":
            raise ValueError("only CPU KV caches can move into shared memory (CUDA: IPC)")
        storages: dict[int, torch.UntypedStorage] = {}
        for layer in kv.layers:
            storage = layer.untyped_storage()
            storages.setdefault(storage.data_ptr(), storage)
        placements: dict[int, int] = {}
        file_bytes = 0
        for key, storage in storages.items():
            placements[key] = file_bytes
            file_bytes += -(-storage.nbytes() // _ALIGNMENT) * _ALIGNMENT
        offsets = [
            placements[layer.untyped_storage().data_ptr()]
            + int(layer.storage_offset()) * layer.element_size()
            for layer in kv.layers
        ]
        self.path = _shared_directory(file_bytes, directory) / owned_name(FILE_PREFIX)
        self._owner = create_reserved(self.path, file_bytes, what="the worker's shared KV")
        try:
            self._map = mmap.mmap(self._owner.fd, file_bytes, flags=mmap.MAP_SHARED)
        except BaseException:
            self.close()
            raise
        try:
            for key, storage in storages.items():
                shared = _copy_into(storage, self._map, placements[key])
                swap = getattr(storage, "_swap_data_ptr_", None)
                if method == "swap" and swap is not None:
                    # Afterwards ``storage`` holds the mapping and ``shared`` the old memory,
                    # freed when ``shared`` goes out of scope.
                    swap(shared)
                else:
                    _set_tensors(kv.layers, key, shared)
        except BaseException:
            self.close()
            raise
        self.description = SharedKVFile(
            path=str(self.path), file_bytes=file_bytes, layout=kv.paged_layout(offsets)
        )

    def close(self) -> None:
        """Removes the file's name and releases its owner lock; the memory stays mapped while
        the tensors live."""
        self.path.unlink(missing_ok=True)
        self._owner.close()


def _copy_into(
    storage: torch.UntypedStorage, mapping: mmap.mmap, offset: int
) -> torch.UntypedStorage:
    """Copies ``storage`` into the mapping at ``offset``; returns a storage over that part."""
    target = np.frombuffer(mapping, dtype=np.uint8, count=storage.nbytes(), offset=offset)
    np.copyto(target, storage_array(storage))
    return torch.from_numpy(target).untyped_storage()


def _set_tensors(layers: Sequence[torch.Tensor], key: int, shared: torch.UntypedStorage) -> None:
    """Points each tensor of the storage at address ``key`` at ``shared`` instead."""
    for layer in layers:
        if layer.untyped_storage().data_ptr() == key:
            layer.set_(shared, layer.storage_offset(), layer.shape, layer.stride())


def _shared_directory(size: int, directory: Path | None) -> Path:
    if directory is not None:
        return directory
    shm = Path("/dev/shm")
    if shm.is_dir():
        stats = os.statvfs(shm)
        if stats.f_bavail * stats.f_frsize >= size:
            return shm
    return Path(tempfile.gettempdir())
