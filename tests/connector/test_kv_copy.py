"""KV blocks to pool slots and back: bit-exact for any block dimension, layout, dtype, device."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest
import torch

from connector.kv_copy import PagedKV, PoolMapping
from server.pool import SharedMemoryPool
from testbed.core import protocol as p
from testbed.core.block_copy import ChunkCopy, item_copies
from tests.support.paged_kv import LAYOUTS, blocks_of, reference_object, snapshot

BLOCK_SIZE = 16


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


@pytest.mark.usefixtures("index_path")
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_one_call_stores_and_loads_many_chunks_in_the_object_layout(layout):
    layers, block_dim = LAYOUTS[layout](num_layers=3, num_blocks=40, block_size=BLOCK_SIZE)
    kv = PagedKV(layers, block_dim, BLOCK_SIZE)
    pool = np.zeros(1 << 20, dtype=np.uint8)
    chunks = [[5, 1, 7, 3], [30, 31], [12, 0, 9, 18]]
    slots, offset = [], 64
    for chunk in chunks:
        slots.append(p.Slot(offset, kv.layer_block_bytes * len(layers) * len(chunk)))
        offset += slots[-1].nbytes + 64
    written = kv.store_chunks(pool, [ChunkCopy(s, c) for s, c in zip(slots, chunks, strict=True)])
    assert written == sum(slot.nbytes for slot in slots)
    for slot, chunk in zip(slots, chunks, strict=True):
        stored = pool[slot.offset : slot.offset + slot.nbytes].tobytes()
        assert stored == reference_object(layers, block_dim, chunk)

    before = snapshot(layers)
    targets = [[20, 21, 22, 23], [24, 25], [26, 27, 28, 29]]
    skips = [1, 0, 4]  # the third chunk is wholly in vLLM's prefix cache: nothing to load
    copies = [ChunkCopy(s, t, k) for s, t, k in zip(slots, targets, skips, strict=True)]
    loaded = kv.load_chunks(pool, copies)
    assert loaded == kv.layer_block_bytes * len(layers) * (3 + 2)
    assert blocks_of(layers, block_dim, [21, 22, 23, 24, 25]) == blocks_of(
        layers, block_dim, [1, 7, 3, 30, 31]
    )
    untouched = [b for b in range(40) if b not in (21, 22, 23, 24, 25)]
    assert blocks_of(layers, block_dim, untouched) == blocks_of(before, block_dim, untouched)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_batch_in_back_to_back_slots_round_trips(layout):
    """A batch the server allocated in one go (slots back to back, chunks of one length) is
    one call where the layers share a buffer; the bytes are the same either way."""
    layers, block_dim = LAYOUTS[layout](num_layers=3, num_blocks=64, block_size=BLOCK_SIZE)
    kv = PagedKV(layers, block_dim, BLOCK_SIZE)
    object_bytes = 4 * kv.layer_block_bytes * len(layers)
    chunks = [[4 * c + 3, 4 * c, 60 - c, 4 * c + 1] for c in range(12)]
    slots = [p.Slot(128 + c * object_bytes, object_bytes) for c in range(len(chunks))]
    pool = np.zeros(128 + len(chunks) * object_bytes, dtype=np.uint8)
    kv.store_chunks(pool, [ChunkCopy(s, c) for s, c in zip(slots, chunks, strict=True)])
    for slot, chunk in zip(slots, chunks, strict=True):
        stored = pool[slot.offset : slot.offset + slot.nbytes].tobytes()
        assert stored == reference_object(layers, block_dim, chunk)
    before = snapshot(layers)
    targets = [[48 + c % 4, 52 + c % 4, 56 + c % 4, 60 + c % 4] for c in range(4)]
    copies = [ChunkCopy(s, t) for s, t in zip(slots[:4], targets, strict=True)]
    assert kv.load_chunks(pool, copies) == 4 * object_bytes
    for chunk, target in zip(chunks[:4], targets, strict=True):
        assert blocks_of(layers, block_dim, target) == blocks_of(before, block_dim, chunk)


@pytest.mark.usefixtures("index_path")
def test_a_bad_chunk_is_refused_before_any_byte_moves():
    layers, block_dim = LAYOUTS["vllm_cpu"](num_layers=2, num_blocks=8, block_size=BLOCK_SIZE)
    kv = PagedKV(layers, block_dim, BLOCK_SIZE)
    object_bytes = 2 * kv.layer_block_bytes * len(layers)
    pool = np.zeros(4 * object_bytes, dtype=np.uint8)
    good = ChunkCopy(p.Slot(0, object_bytes), [0, 1])
    for bad, message in [
        (ChunkCopy(p.Slot(object_bytes, object_bytes), [7, 8]), "outside 0..7"),
        (ChunkCopy(p.Slot(object_bytes, 100), [2, 3]), "does not hold"),
        (ChunkCopy(p.Slot(3 * object_bytes + 64, object_bytes), [2, 3]), "outside a"),
        (ChunkCopy(p.Slot(object_bytes, object_bytes), [2, 3], skip_blocks=1), "whole chunks"),
    ]:
        with pytest.raises(ValueError, match=message):
            kv.store_chunks(pool, [good, bad])
        assert not pool.any()
    before = snapshot(layers)
    pool[:] = 7
    with pytest.raises(ValueError, match="skip_blocks 3"):
        kv.load_chunks(pool, [good, ChunkCopy(p.Slot(object_bytes, object_bytes), [2, 3], 3)])
    every = list(range(8))
    assert blocks_of(layers, block_dim, every) == blocks_of(before, block_dim, every)


def test_copies_use_their_own_threads_and_leave_torch_threads_alone():
    layers, block_dim = LAYOUTS["block_major"](num_layers=4, num_blocks=16, block_size=BLOCK_SIZE)
    threads = torch.get_num_threads()
    single = PagedKV(layers, block_dim, BLOCK_SIZE)
    pooled = PagedKV(layers, block_dim, BLOCK_SIZE, num_copy_threads=2)
    nbytes = 3 * single.layer_block_bytes * len(layers)
    pools = [np.zeros(nbytes, dtype=np.uint8) for _ in range(2)]
    for kv, pool in zip((single, pooled), pools, strict=True):
        kv.store_chunks(pool, [ChunkCopy(p.Slot(0, nbytes), [9, 2, 14])])
        kv.close()
    assert pools[0].tobytes() == pools[1].tobytes() == reference_object(layers, 0, [9, 2, 14])
    assert torch.get_num_threads() == threads


def test_a_slot_of_the_wrong_size_is_refused():
    kv = PagedKV((torch.zeros(8, 32, 4, dtype=torch.float16),), 0, block_size=32)
    with pytest.raises(ValueError, match="does not hold"):
        kv.save(torch.zeros(1 << 16, dtype=torch.uint8), p.Slot(0, 100), [0, 1])


def test_layers_of_different_strides_are_refused():
    layer = torch.zeros(8, 4, 6)
    with pytest.raises(ValueError, match="share shape, strides"):
        PagedKV((layer, layer.transpose(1, 2).contiguous().transpose(1, 2)), 0, block_size=4)


def test_the_workers_pool_mapping_is_populated_since_every_pool_is_reserved():
    size = 8 << 20
    with SharedMemoryPool(size) as pool:
        mapping = PoolMapping(str(pool.path), size)
        try:
            assert mapping.populated
            assert _resident_bytes_of_mapping(str(pool.path)) >= size
            mapping.array[:16] = 3
            assert pool.array[:16].tolist() == [3] * 16  # one file, two mappings
        finally:
            mapping.close()


def _resident_bytes_of_mapping(path: str) -> int:
    """Rss of this process's mapping of ``path`` (from /proc/self/smaps)."""
    rss, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:
                inside = fields[-1] == path
            elif inside and fields[0] == "Rss:":
                rss += int(fields[1]) * 1024
    return rss


@pytest.mark.skipif(
    not hasattr(mmap, "MAP_POPULATE") or not os.path.exists("/proc/self/smaps"), reason="Linux only"
)
def test_smaps_reader_sees_a_lazy_mapping_as_empty(tmp_path):
    path = tmp_path / "lazy"
    path.write_bytes(b"")
    os.truncate(path, 1 << 20)
    with open(path, "r+b") as f:
        lazy = mmap.mmap(f.fileno(), 1 << 20)
    try:
        assert _resident_bytes_of_mapping(str(path)) == 0
    finally:
        lazy.close()


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)"
)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_cuda_kv_is_staged_through_the_host_pool_in_the_same_layout(layout):
    host, block_dim = LAYOUTS[layout](num_layers=2, num_blocks=16, block_size=BLOCK_SIZE)
    layers = tuple(layer.cuda() for layer in host)
    kv = PagedKV(layers, block_dim, BLOCK_SIZE)
    pool = torch.zeros(1 << 20, dtype=torch.uint8)
    slot = p.Slot(64, 3 * kv.layer_block_bytes * len(layers))
    kv.store_chunks(pool, [ChunkCopy(slot, [4, 0, 9])])
    stored = pool[slot.offset : slot.offset + slot.nbytes].numpy().tobytes()
    assert stored == reference_object(host, block_dim, [4, 0, 9])
    kv.load_chunks(pool, [ChunkCopy(slot, [5, 6, 7], skip_blocks=1)])
    back = tuple(layer.cpu() for layer in layers)
    assert blocks_of(back, block_dim, [6, 7]) == blocks_of(host, block_dim, [0, 9])
    assert blocks_of(back, block_dim, [5]) == blocks_of(host, block_dim, [5])


def test_an_items_chunks_split_into_copies_and_blocks_to_recompute():
    present = [p.Slot(offset=0, nbytes=64), None, p.Slot(offset=64, nbytes=64)]
    blocks = list(range(10, 22))  # 3 chunks of 4 blocks
    copies, missing = item_copies(blocks, present, 4, skip_blocks=5)
    # chunk 0 is wholly skipped (its blocks are the engine's), chunk 1 is gone: recompute
    # its blocks but the skipped first one, chunk 2 copies whole.
    assert [(c.slot.offset, list(c.block_ids), c.skip_blocks) for c in copies] == [
        (0, [10, 11, 12, 13], 4),
        (64, [18, 19, 20, 21], 0),
    ]
    assert missing == [15, 16, 17]
