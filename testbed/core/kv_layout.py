"""Where a worker's paged KV lives in memory, and how one pool object lays out its bytes.

Plain data shared by the worker side (``connector.kv_copy``, ``connector.shared_kv``) and the
server (``server.kv_copier``); no torch, no numpy, so a registration message can carry a
:class:`SharedKVFile` and the server can decode it in the base install.

Paged KV: ``num_layers`` tensors of one ``shape``, ``dtype`` and byte ``strides``; layer ``l``
starts ``layer_offsets_bytes[l]`` bytes into its buffer (a torch storage on the worker, the
shared file on the server). Dimension ``block_dim`` indexes the KV blocks of ``block_size``
tokens. Strides are free: layers may be separate tensors, views of one allocation laid out
layer-major (vLLM's ``LBHNC``, the CPU backend's), block-major (``BLHNC``), or split K/V in
front of the blocks (``(2, num_blocks, ...)``).

Pool object layout (one chunk of one KV rank, ``n`` blocks ``b_0 … b_{n-1}``): for each layer
in order, that layer's blocks as a C-contiguous array of the layer's shape with
``shape[block_dim]`` replaced by ``n``, i.e. ``layer.index_select(block_dim, [b_0 …])``; no
padding between layers. An object is therefore ``num_layers × n × layer_block_bytes`` bytes
and its bytes do not depend on the strides: the worker-side copy and the server-side copier
write and read the same objects, whatever each side's view of the KV.
"""

from __future__ import annotations

import math
from typing import Annotated

import msgspec

FILE_PREFIX = "kvtb-kv-"
"""Name prefix of shared KV files (the server opens no other file a registration names)."""

NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]


class PagedLayout(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The geometry of a worker's paged KV tensors inside their buffer(s)."""

    layer_offsets_bytes: list[NonNegative]
    """Byte offset of each layer's element ``[0, 0, …]`` in its buffer, in layer order."""
    shape: list[Positive]
    """Shape of every layer tensor (dimension ``block_dim`` is the number of KV blocks)."""
    strides_bytes: list[NonNegative]
    """Byte strides of every layer tensor (torch's element strides × ``itemsize``)."""
    dtype: str
    """Element type name as torch spells it (``float16``, ``bfloat16``, …); informative."""
    itemsize: Positive
    """Bytes per element; the copies move bytes and need nothing else of the dtype."""
    block_dim: NonNegative
    """Dimension of ``shape`` that indexes KV blocks."""
    block_size: Positive
    """Tokens per KV block."""

    def __post_init__(self) -> None:
        problems = []
        if not self.layer_offsets_bytes:
            problems.append("no layers")
        if len(self.strides_bytes) != len(self.shape):
            problems.append(f"{len(self.shape)} dimensions but {len(self.strides_bytes)} strides")
        if self.block_dim >= len(self.shape):
            problems.append(f"block_dim {self.block_dim} outside a {len(self.shape)}-d shape")
        if any(stride % self.itemsize for stride in self.strides_bytes):
            problems.append(f"strides {self.strides_bytes} are not multiples of {self.itemsize}")
        if any(offset % self.itemsize for offset in self.layer_offsets_bytes):
            problems.append(f"layer offsets are not multiples of {self.itemsize}")
        if problems:
            raise ValueError("invalid paged KV layout: " + "; ".join(problems))

    @property
    def num_layers(self) -> int:
        return len(self.layer_offsets_bytes)

    @property
    def num_blocks(self) -> int:
        return self.shape[self.block_dim]

    @property
    def layer_block_bytes(self) -> int:
        """Bytes of one block of one layer."""
        return math.prod(self.shape) // self.num_blocks * self.itemsize

    @property
    def bytes_per_token(self) -> int:
        """Bytes of KV per token, all layers."""
        return self.layer_block_bytes * self.num_layers // self.block_size

    def object_bytes(self, num_blocks: int) -> int:
        """Size of a pool object holding ``num_blocks`` blocks of every layer."""
        return num_blocks * self.layer_block_bytes * self.num_layers

    def layer_extent_bytes(self) -> int:
        """Bytes from a layer's offset to one past its last byte."""
        return (
            sum(
                (size - 1) * stride
                for size, stride in zip(self.shape, self.strides_bytes, strict=True)
            )
            + self.itemsize
        )


class SharedKVFile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A worker's KV tensors living in a shared-memory file that the server can map.

    Made by ``connector.shared_kv``; ``layout.layer_offsets_bytes`` are offsets into the file.
    """

    path: str
    """The file (in ``/dev/shm`` where it has room)."""
    file_bytes: Positive
    """Size of the file; every layer lies inside it."""
    layout: PagedLayout

    def __post_init__(self) -> None:
        end = max(self.layout.layer_offsets_bytes) + self.layout.layer_extent_bytes()
        if end > self.file_bytes:
            raise ValueError(f"layers reach byte {end} of a {self.file_bytes}-byte file")
