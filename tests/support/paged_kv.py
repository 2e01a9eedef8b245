"""Paged KV tensors in the layouts the data path meets, and the reference object bytes.

Each factory returns ``(layers, block_dim)`` with seeded random contents:

- ``separate``: one tensor per layer (the replay harness; vLLM before one-buffer allocation);
- ``vllm_cpu``: vLLM 0.32's CPU backend: one int8 allocation viewed per layer as
  ``(num_blocks, num_kv_heads, block_size, 2 * head_size)``, layer-major (``LBHNC``), as
  ``vllm.v1.kv_cache_interface.create_kv_cache_views`` makes them;
- ``block_major``: the same views laid out block-major (``BLHNC``: a block holds every
  layer's page), so a layer's blocks are strided;
- ``split_kv``: K and V in front of the blocks, ``(2, num_blocks, block_size, heads, dim)``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from connector.kv_copy import PagedKV
from testbed.core.kv_layout import PagedLayout

Layers = tuple[torch.Tensor, ...]


def separate(
    num_layers: int, num_blocks: int, block_size: int, seed: int = 0
) -> tuple[Layers, int]:
    g = torch.Generator().manual_seed(seed)
    layers = tuple(
        torch.randn(num_blocks, block_size, 4, 8, generator=g).half() for _ in range(num_layers)
    )
    return layers, 0


def _one_buffer(
    num_layers: int, num_blocks: int, block_size: int, seed: int, block_major: bool
) -> tuple[Layers, int]:
    heads, content = 2, 2 * 16  # 2 KV heads, K and V of head_size 16
    dtype = torch.bfloat16
    page = heads * block_size * content * dtype.itemsize
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(-128, 127, (num_layers * num_blocks * page,), generator=g, dtype=torch.int8)
    layer_stride, block_stride = (
        (page, num_layers * page) if block_major else (num_blocks * page, page)
    )
    shape = (num_layers, num_blocks, heads, block_size, content * dtype.itemsize)
    strides = (
        layer_stride,
        block_stride,
        block_size * content * dtype.itemsize,
        content * dtype.itemsize,
        1,
    )
    view_5d = torch.as_strided(raw, shape, strides)
    return tuple(view_5d[layer].view(dtype) for layer in range(num_layers)), 0


def vllm_cpu(
    num_layers: int, num_blocks: int, block_size: int, seed: int = 0
) -> tuple[Layers, int]:
    return _one_buffer(num_layers, num_blocks, block_size, seed, block_major=False)


def block_major(
    num_layers: int, num_blocks: int, block_size: int, seed: int = 0
) -> tuple[Layers, int]:
    return _one_buffer(num_layers, num_blocks, block_size, seed, block_major=True)


def split_kv(
    num_layers: int, num_blocks: int, block_size: int, seed: int = 0
) -> tuple[Layers, int]:
    g = torch.Generator().manual_seed(seed)
    layers = tuple(
        torch.randn(2, num_blocks, block_size, 2, 8, generator=g).to(torch.float32)
        for _ in range(num_layers)
    )
    return layers, 1


LAYOUTS: dict[str, Callable[..., tuple[Layers, int]]] = {
    "separate": separate,
    "vllm_cpu": vllm_cpu,
    "block_major": block_major,
    "split_kv": split_kv,
}


def reference_object(layers: Layers, block_dim: int, block_ids: list[int]) -> bytes:
    """The pool object of ``block_ids``, by definition (``testbed.core.kv_layout``)."""
    index = torch.tensor(block_ids)
    return b"".join(
        layer.index_select(block_dim, index).contiguous().view(torch.uint8).numpy().tobytes()
        for layer in layers
    )


def blocks_of(layers: Layers, block_dim: int, block_ids: list[int]) -> list[bytes]:
    """Per layer, the bytes of ``block_ids`` (to compare blocks across positions)."""
    return [
        layer.index_select(block_dim, torch.tensor(block_ids))
        .contiguous()
        .view(torch.uint8)
        .numpy()
        .tobytes()
        for layer in layers
    ]


def kv_buffers(
    layers: Layers, block_dim: int, block_size: int
) -> tuple[PagedLayout, list[torch.Tensor]]:
    """The layers' geometry and, per layer, its storage as a flat uint8 tensor (what a copy
    engine is built over)."""
    kv = PagedKV(layers, block_dim, block_size)
    offsets, buffers = kv.storage_views()
    return kv.paged_layout(offsets), buffers


def snapshot(layers: Layers) -> list[torch.Tensor]:
    return [layer.clone() for layer in layers]
