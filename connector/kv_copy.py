"""Copying KV blocks between a worker's paged KV tensors and slots of the shared pool.

Runs in each worker process (vLLM worker or the replay harness). An object in the pool holds
one chunk of one KV rank: for each layer in order, the chunk's blocks as
``layer.index_select(block_dim, block_ids)`` laid out contiguously. Store and retrieve use the
same layout, so a round trip is bit-exact whatever the tensors' own layout.

KV tensors on a GPU are gathered on the device and staged through host memory into the pool
(and back); the server-driven CUDA IPC path of DESIGN.md §2 is not implemented yet.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from dataclasses import dataclass

import torch

from testbed import protocol as p


@dataclass(frozen=True)
class PagedKV:
    """A worker's KV caches: one tensor per layer, the block index on ``block_dim``."""

    layers: tuple[torch.Tensor, ...]
    block_dim: int
    block_size: int

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("no KV cache tensors to register")
        first = self.layers[0]
        for layer in self.layers:
            if layer.shape != first.shape or layer.dtype != first.dtype:
                raise ValueError(
                    "all KV cache layers must share shape and dtype "
                    f"({tuple(layer.shape)} {layer.dtype} vs {tuple(first.shape)} {first.dtype})"
                )

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

    def _selection_shape(self, num_blocks: int) -> list[int]:
        shape = list(self.layers[0].shape)
        shape[self.block_dim] = num_blocks
        return shape

    def _slot_views(self, pool: torch.Tensor, slot: p.Slot, num_blocks: int) -> list[torch.Tensor]:
        per_layer = num_blocks * self.layer_block_bytes
        if per_layer * len(self.layers) != slot.nbytes:
            raise ValueError(
                f"slot of {slot.nbytes} bytes does not hold {num_blocks} blocks of "
                f"{len(self.layers)} layers ({per_layer} bytes each)"
            )
        dtype = self.layers[0].dtype
        shape = self._selection_shape(num_blocks)
        return [
            pool[slot.offset + i * per_layer : slot.offset + (i + 1) * per_layer]
            .view(dtype)
            .view(shape)
            for i in range(len(self.layers))
        ]

    def save(self, pool: torch.Tensor, slot: p.Slot, block_ids: list[int]) -> None:
        """Copies the blocks ``block_ids`` of every layer into ``slot``."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.layers[0].device)
        for layer, view in zip(
            self.layers, self._slot_views(pool, slot, len(block_ids)), strict=True
        ):
            if layer.device.type == "cpu":
                torch.index_select(layer, self.block_dim, index, out=view)
            else:
                view.copy_(torch.index_select(layer, self.block_dim, index))

    def load(
        self, pool: torch.Tensor, slot: p.Slot, block_ids: list[int], skip_blocks: int = 0
    ) -> None:
        """Copies ``slot`` into the blocks ``block_ids``, except the first ``skip_blocks``."""
        device = self.layers[0].device
        index = torch.tensor(block_ids[skip_blocks:], dtype=torch.long, device=device)
        if index.numel() == 0:
            return
        views = self._slot_views(pool, slot, len(block_ids))
        for layer, view in zip(self.layers, views, strict=True):
            source = view.narrow(self.block_dim, skip_blocks, len(block_ids) - skip_blocks)
            layer.index_copy_(self.block_dim, index, source.to(device, non_blocking=False))


class PoolMapping:
    """The server's pool file mapped into this process, as a flat uint8 tensor."""

    def __init__(self, path: str, size: int) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)

    def close(self) -> None:
        del self.tensor
        with contextlib.suppress(BufferError):  # a tensor view is still alive; it keeps the map
            self._map.close()
