"""Server-side copies from the engine's shared KV: the same objects as the worker's copies."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import numpy as np
import pytest
import torch

from connector.kv_copy import PagedKV
from connector.shared_kv import SharedKV
from server.kv_copier import EngineKV
from server.pool import SharedMemoryPool
from testbed.core import protocol as p
from testbed.core.block_copy import ChunkCopy
from testbed.core.kv_layout import SharedKVFile
from tests.support.paged_kv import LAYOUTS, blocks_of, reference_object, snapshot

BLOCK_SIZE = 16
NUM_BLOCKS = 24


class Engine:
    """One worker's KV in shared memory, seen from both sides: the worker's copy engine and
    the server's mapping of the file (through the wire form of the description)."""

    def __init__(self, layout: str, num_layers: int = 3) -> None:
        self.layers, self.block_dim = LAYOUTS[layout](num_layers, NUM_BLOCKS, BLOCK_SIZE)
        self.shared = SharedKV(self.layers, self.block_dim, BLOCK_SIZE)
        wire = msgspec.msgpack.encode(self.shared.description)
        self.server = EngineKV(msgspec.msgpack.decode(wire, type=SharedKVFile))
        self.worker = PagedKV(self.layers, self.block_dim, BLOCK_SIZE)

    def object_bytes(self, num_blocks: int) -> int:
        return num_blocks * self.worker.layer_block_bytes * len(self.layers)

    def close(self) -> None:
        self.server.close()
        self.shared.close()


@pytest.fixture
def pool():
    with SharedMemoryPool(4 << 20) as pool:
        yield pool


def _slots(engine: Engine, chunks: list[list[int]]) -> list[p.Slot]:
    slots, offset = [], 128
    for chunk in chunks:
        slots.append(p.Slot(offset, engine.object_bytes(len(chunk))))
        offset += slots[-1].nbytes + 64
    return slots


def _store(engine: Engine, mode: str, pool: SharedMemoryPool, copies: list[ChunkCopy]) -> int:
    if mode == "server":
        return engine.server.store(pool.array, copies)
    return engine.worker.store_chunks(pool.array, copies)


def _retrieve(engine: Engine, mode: str, pool: SharedMemoryPool, copies: list[ChunkCopy]) -> int:
    if mode == "server":
        return engine.server.retrieve(pool.array, copies)
    return engine.worker.load_chunks(pool.array, copies)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize(
    ("store_mode", "retrieve_mode"),
    [("server", "server"), ("worker", "server"), ("server", "worker")],
)
@pytest.mark.usefixtures("index_path")
def test_objects_round_trip_bit_exact_across_modes(layout, store_mode, retrieve_mode, pool):
    engine = Engine(layout)
    try:
        chunks = [[3, 9, 1, 20], [7, 8], [15, 2, 11, 4]]
        slots = _slots(engine, chunks)
        stores = [ChunkCopy(s, c) for s, c in zip(slots, chunks, strict=True)]
        assert _store(engine, store_mode, pool, stores) == sum(s.nbytes for s in slots)
        for slot, chunk in zip(slots, chunks, strict=True):
            stored = pool.array[slot.offset : slot.offset + slot.nbytes].tobytes()
            assert stored == reference_object(engine.layers, engine.block_dim, chunk)

        before = snapshot(engine.layers)
        targets = [[12, 13, 14, 16], [17, 18], [19, 21, 22, 23]]
        skips = [2, 0, 1]  # skip_first_n_tokens: 2 blocks, none, 1 block
        retrieves = [ChunkCopy(s, t, k) for s, t, k in zip(slots, targets, skips, strict=True)]
        loaded = _retrieve(engine, retrieve_mode, pool, retrieves)
        assert loaded == engine.object_bytes(2 + 2 + 3)
        got = blocks_of(engine.layers, engine.block_dim, [14, 16, 17, 18, 21, 22, 23])
        assert got == blocks_of(before, engine.block_dim, [1, 20, 7, 8, 2, 11, 4])
        untouched = [b for b in range(NUM_BLOCKS) if b not in (14, 16, 17, 18, 21, 22, 23)]
        assert blocks_of(engine.layers, engine.block_dim, untouched) == blocks_of(
            before, engine.block_dim, untouched
        )
    finally:
        engine.close()


def test_the_server_sees_what_the_engine_wrote_after_registration(pool):
    engine = Engine("vllm_cpu", num_layers=2)
    try:
        engine.layers[1][5].fill_(3.0)  # the forward pass writes a block, later on
        slot = p.Slot(0, engine.object_bytes(1))
        engine.server.store(pool.array, [ChunkCopy(slot, [5])])
        layer_bytes = engine.worker.layer_block_bytes
        second_layer = pool.array[layer_bytes : 2 * layer_bytes]
        expected = torch.full_like(engine.layers[1][5], 3.0).view(torch.uint8).numpy().tobytes()
        assert second_layer.tobytes() == expected
    finally:
        engine.close()


def test_only_a_shared_kv_file_of_the_right_size_is_opened(tmp_path):
    layers, block_dim = LAYOUTS["separate"](1, 4, BLOCK_SIZE)
    with SharedKV(layers, block_dim, BLOCK_SIZE) as shared:
        description = shared.description
        short = tmp_path / "kvtb-kv-short"
        short.write_bytes(b"\0" * 64)
        with pytest.raises(ValueError, match="registration says"):
            EngineKV(msgspec.structs.replace(description, path=str(short)))
        other = tmp_path / "secrets"
        other.write_bytes(b"\0" * description.file_bytes)
        with pytest.raises(ValueError, match="not a shared KV file"):
            EngineKV(msgspec.structs.replace(description, path=str(other)))
        link = tmp_path / "kvtb-kv-link"
        link.symlink_to(other)
        with pytest.raises(OSError):
            EngineKV(msgspec.structs.replace(description, path=str(link)))


def test_the_server_side_imports_no_torch():
    code = (
        "import sys, server.kv_copier, server.pool, testbed.core.block_copy, "
        "testbed.core.kv_layout; "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_copies_are_threaded_on_request_with_the_same_bytes(pool):
    engine = Engine("block_major", num_layers=4)
    try:
        threaded = EngineKV(engine.shared.description, num_threads=2)
        slot_a, slot_b = _slots(engine, [[1, 2, 3], [1, 2, 3]])
        engine.server.store(pool.array, [ChunkCopy(slot_a, [1, 2, 3])])
        threaded.store(pool.array, [ChunkCopy(slot_b, [1, 2, 3])])
        a = pool.array[slot_a.offset : slot_a.offset + slot_a.nbytes]
        b = pool.array[slot_b.offset : slot_b.offset + slot_b.nbytes]
        assert np.array_equal(a, b)
        before = snapshot(engine.layers)
        threaded.retrieve(pool.array, [ChunkCopy(slot_b, [20, 21, 22], skip_blocks=1)])
        got = blocks_of(engine.layers, engine.block_dim, [20, 21, 22])
        assert got == blocks_of(before, engine.block_dim, [20, 2, 3])
        threaded.close()
    finally:
        engine.close()
