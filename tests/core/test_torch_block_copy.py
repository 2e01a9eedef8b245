"""The torch copy engine (CUDA KV's) writes and reads the numpy engine's objects, bit for bit.

Run on CPU tensors: the engine is device-agnostic torch, so the logic that decides which runs
go where (groups of slots, segments, element widths, staging, skipped blocks) is checked here
without a GPU; ``tests/gpu`` runs the same engine on CUDA KV mapped through CUDA IPC.
"""

from __future__ import annotations

import pytest
import torch

from testbed.core import protocol as p
from testbed.core.block_copy import ChunkCopy
from testbed.core.torch_block_copy import TorchBlockCopier
from tests.support.paged_kv import LAYOUTS, blocks_of, kv_buffers, reference_object, snapshot

BLOCK_SIZE = 16
NUM_BLOCKS = 32


def _copier(layout: str, **options: object) -> tuple[tuple[torch.Tensor, ...], int, object]:
    layers, block_dim = LAYOUTS[layout](num_layers=3, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    paged, buffers = kv_buffers(layers, block_dim, BLOCK_SIZE)
    return layers, block_dim, TorchBlockCopier(paged, buffers, **options)  # type: ignore[arg-type]


def _slots(object_block_bytes: int, chunks: list[list[int]], gap: int) -> list[p.Slot]:
    slots, offset = [], 256
    for chunk in chunks:
        slots.append(p.Slot(offset, len(chunk) * object_block_bytes))
        offset += slots[-1].nbytes + gap
    return slots


@pytest.mark.usefixtures("index_path")
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("gap", [0, 64], ids=["back-to-back", "scattered"])
@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
def test_objects_round_trip_bit_exact_with_skipped_blocks_untouched(layout, gap, staged):
    layers, block_dim, copier = _copier(layout, force_staging=staged)
    per_block = copier.geometry.object_block_bytes
    chunks = [[5, 1, 7, 3], [30, 31, 2, 9], [12, 0, 9, 18]]
    slots = _slots(per_block, chunks, gap)
    pool = torch.zeros(1 << 20, dtype=torch.uint8)
    written = copier.gather(pool, [ChunkCopy(s, c) for s, c in zip(slots, chunks, strict=True)])
    assert written == sum(s.nbytes for s in slots)
    for slot, chunk in zip(slots, chunks, strict=True):
        stored = pool[slot.offset : slot.offset + slot.nbytes].numpy().tobytes()
        assert stored == reference_object(layers, block_dim, chunk)

    before = snapshot(layers)
    targets = [[20, 21, 22, 23], [24, 25, 26, 27], [28, 29, 4, 6]]
    skips = [1, 0, 4]  # skip_first_n_tokens: one block, none, the whole chunk
    loads = [ChunkCopy(s, t, k) for s, t, k in zip(slots, targets, skips, strict=True)]
    assert copier.scatter(pool, loads) == per_block * (3 + 4 + 0)
    written_blocks = [21, 22, 23, 24, 25, 26, 27]
    assert blocks_of(layers, block_dim, written_blocks) == blocks_of(
        before, block_dim, [1, 7, 3, 30, 31, 2, 9]
    )
    untouched = [b for b in range(NUM_BLOCKS) if b not in written_blocks]
    assert blocks_of(layers, block_dim, untouched) == blocks_of(before, block_dim, untouched)


@pytest.mark.parametrize("width", [16, 8, 2, 1])
def test_every_element_width_moves_the_same_bytes(width):
    layers, block_dim, copier = _copier("vllm_cpu", max_width=width)
    assert copier.width == width
    slot = p.Slot(128, 2 * copier.geometry.object_block_bytes)
    pool = torch.zeros(1 << 18, dtype=torch.uint8)
    copier.gather(pool, [ChunkCopy(slot, [3, 8])])
    assert pool[128 : 128 + slot.nbytes].numpy().tobytes() == reference_object(
        layers, block_dim, [3, 8]
    )


def test_a_slot_at_an_odd_address_narrows_the_width_for_that_group_only():
    layers, block_dim, copier = _copier("separate")
    odd = p.Slot(3, copier.geometry.object_block_bytes)
    pool = torch.zeros(1 << 16, dtype=torch.uint8)
    copier.gather(pool, [ChunkCopy(odd, [6])])
    assert pool[3 : 3 + odd.nbytes].numpy().tobytes() == reference_object(layers, block_dim, [6])
    assert copier.width > 1


def test_bad_ids_slots_and_skips_are_refused_before_any_byte_moves():
    layers, _, copier = _copier("split_kv")
    pool = torch.zeros(1 << 16, dtype=torch.uint8)
    one = copier.geometry.object_block_bytes
    before = snapshot(layers)
    bad = [
        ([ChunkCopy(p.Slot(0, one), [NUM_BLOCKS])], "outside"),
        ([ChunkCopy(p.Slot(0, one), [1]), ChunkCopy(p.Slot(one, 2 * one), [2])], "does not hold"),
        ([ChunkCopy(p.Slot(pool.numel() - one + 64, one), [1])], "outside"),
        ([ChunkCopy(p.Slot(0, one), [1], skip_blocks=2)], "skip_blocks"),
    ]
    for copies, message in bad:
        with pytest.raises(ValueError, match=message):
            copier.scatter(pool, copies)
    with pytest.raises(ValueError, match="whole chunks"):
        copier.gather(pool, [ChunkCopy(p.Slot(0, one), [1], skip_blocks=1)])
    assert all(torch.equal(a, b) for a, b in zip(layers, before, strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)"
)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("pool_device", ["pinned-host", "cuda"])
def test_cuda_kv_round_trips_through_host_and_device_pools(layout, pool_device):
    host, block_dim = LAYOUTS[layout](num_layers=3, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    layers = tuple(layer.cuda() for layer in host)
    paged, buffers = kv_buffers(layers, block_dim, BLOCK_SIZE)
    copier = TorchBlockCopier(paged, buffers)
    if pool_device == "cuda":
        pool = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    else:
        pool = torch.zeros(1 << 20, dtype=torch.uint8, pin_memory=True)
    slots = _slots(copier.geometry.object_block_bytes, [[4, 0, 9, 2], [7, 8, 1, 3]], gap=0)
    copier.gather(pool, [ChunkCopy(slots[0], [4, 0, 9, 2]), ChunkCopy(slots[1], [7, 8, 1, 3])])
    torch.cuda.synchronize()
    stored = pool[slots[0].offset : slots[0].offset + slots[0].nbytes].cpu().numpy().tobytes()
    assert stored == reference_object(host, block_dim, [4, 0, 9, 2])
    copier.scatter(pool, [ChunkCopy(slots[1], [20, 21, 22, 23], skip_blocks=1)])
    torch.cuda.synchronize()
    back = tuple(layer.cpu() for layer in layers)
    assert blocks_of(back, block_dim, [21, 22, 23]) == blocks_of(host, block_dim, [8, 1, 3])
    assert blocks_of(back, block_dim, [20]) == blocks_of(host, block_dim, [20])
