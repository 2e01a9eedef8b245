"""KV blocks to pool slots and back: bit-exact for any block dimension, dtype and device."""

from __future__ import annotations

import pytest
import torch

from connector.kv_copy import PagedKV
from testbed import protocol as p


@pytest.mark.parametrize(
    ("shape", "block_dim", "dtype"),
    [
        ((16, 32, 8), 0, torch.float16),
        ((2, 16, 32, 4), 1, torch.bfloat16),
        ((16, 1, 32, 128), 0, torch.float32),
    ],
)
def test_save_then_load_into_other_blocks_is_bit_exact(shape, block_dim, dtype):
    layers = tuple(torch.randn(shape).to(dtype) for _ in range(3))
    kv = PagedKV(layers, block_dim, block_size=32)
    pool = torch.zeros(1 << 20, dtype=torch.uint8)
    nbytes = 4 * kv.layer_block_bytes * len(layers)
    slot = p.Slot(4096, nbytes)
    kv.save(pool, slot, [1, 2, 3, 4])
    kv.load(pool, slot, [8, 9, 10, 11], skip_blocks=1)
    for layer in layers:

        def blocks(ids: list[int], layer: torch.Tensor = layer) -> torch.Tensor:
            return layer.index_select(block_dim, torch.tensor(ids))

        loaded, source = blocks([9, 10, 11]), blocks([2, 3, 4])
        assert torch.equal(loaded.view(torch.uint8), source.view(torch.uint8))
        assert not torch.equal(blocks([1]), blocks([8]))  # skipped: untouched
    assert kv.bytes_per_token * 32 == kv.layer_block_bytes * len(layers)


def test_a_slot_of_the_wrong_size_is_refused():
    kv = PagedKV((torch.zeros(8, 32, 4, dtype=torch.float16),), 0, block_size=32)
    with pytest.raises(ValueError, match="does not hold"):
        kv.save(torch.zeros(1 << 16, dtype=torch.uint8), p.Slot(0, 100), [0, 1])


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)"
)
def test_cuda_kv_is_staged_through_the_host_pool():
    layers = tuple(torch.randn(16, 32, 8, device="cuda", dtype=torch.float16) for _ in range(2))
    kv = PagedKV(layers, 0, block_size=32)
    pool = torch.zeros(1 << 20, dtype=torch.uint8)
    slot = p.Slot(0, 2 * kv.layer_block_bytes * len(layers))
    kv.save(pool, slot, [0, 1])
    kv.load(pool, slot, [5, 6])
    for layer in layers:
        assert torch.equal(layer[[0, 1]], layer[[5, 6]])
