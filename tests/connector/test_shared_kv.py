"""KV tensors moved into a shared-memory file in place: the engine's tensors keep working."""

from __future__ import annotations

import mmap
import os

import msgspec
import numpy as np
import pytest
import torch

from connector.kv_copy import PagedKV
from connector.shared_kv import SharedKV
from testbed.core import protocol as p
from testbed.core.block_copy import ChunkCopy
from testbed.core.kv_layout import SharedKVFile
from tests.support.paged_kv import LAYOUTS, blocks_of, reference_object

BLOCK_SIZE = 16


def _file_bytes(path: str, offset: int, nbytes: int) -> bytes:
    """Bytes of the file as another process would read them (not through our mapping)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, nbytes, offset)
    finally:
        os.close(fd)


def _map_file(path: str) -> np.ndarray:
    """An independent writable mapping of the file (what the server does)."""
    fd = os.open(path, os.O_RDWR)
    try:
        return np.frombuffer(mmap.mmap(fd, os.fstat(fd).st_size), dtype=np.uint8)
    finally:
        os.close(fd)


def _layer_in_file(file: np.ndarray, shared: SharedKVFile, layer: int) -> np.ndarray:
    """Layer ``layer`` read from the file through the description alone."""
    layout = shared.layout
    return np.ndarray(
        shape=tuple(layout.shape),
        dtype=np.dtype((np.void, layout.itemsize)),
        buffer=file,
        offset=layout.layer_offsets_bytes[layer],
        strides=tuple(layout.strides_bytes),
    )


@pytest.mark.parametrize("method", ["swap", "set"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_tensors_move_with_shape_strides_dtype_and_contents(layout, method):
    layers, block_dim = LAYOUTS[layout](num_layers=3, num_blocks=12, block_size=BLOCK_SIZE)
    before = [(t.shape, t.stride(), t.dtype, t.storage_offset()) for t in layers]
    contents = blocks_of(layers, block_dim, list(range(12)))
    with SharedKV(layers, block_dim, BLOCK_SIZE, method=method) as shared:
        assert [(t.shape, t.stride(), t.dtype, t.storage_offset()) for t in layers] == before
        assert blocks_of(layers, block_dim, list(range(12))) == contents
        shared_layout = shared.description.layout
        file = _map_file(shared.description.path)
        for number, layer in enumerate(layers):
            raw = layer.contiguous().view(torch.uint8).numpy().tobytes()
            assert _layer_in_file(file, shared.description, number).tobytes() == raw
        assert shared_layout.shape == list(layers[0].shape)
        assert shared_layout.strides_bytes == [s * layers[0].element_size() for s in before[0][1]]
        assert (shared_layout.block_dim, shared_layout.block_size) == (block_dim, BLOCK_SIZE)


@pytest.mark.parametrize("method", ["swap", "set"])
def test_writes_through_the_original_tensors_reach_the_file_and_back(method):
    layers, block_dim = LAYOUTS["vllm_cpu"](num_layers=2, num_blocks=8, block_size=BLOCK_SIZE)
    bound_view = layers[1][3]  # a view the engine took earlier (vLLM binds such views)
    with SharedKV(layers, block_dim, BLOCK_SIZE, method=method) as shared:
        file = _map_file(shared.description.path)
        offset = shared.description.layout.layer_offsets_bytes[1]
        page = shared.description.layout.strides_bytes[0]

        layers[1][3].fill_(1.5)  # the engine writes block 3 of layer 1...
        expected = torch.full((page // 2,), 1.5, dtype=torch.bfloat16).view(torch.uint8).numpy()
        assert file[offset + 3 * page : offset + 4 * page].tobytes() == expected.tobytes()

        file[offset + 5 * page : offset + 6 * page] = 0  # ...and the server writes block 5
        assert not layers[1][5].view(torch.uint8).any()
        if method == "swap":  # every view of the storage follows, not only the registered ones
            assert torch.equal(bound_view, layers[1][3])
            assert bound_view.data_ptr() == layers[1][3].data_ptr()


def test_separate_layer_tensors_share_one_file():
    layers, block_dim = LAYOUTS["separate"](num_layers=4, num_blocks=6, block_size=BLOCK_SIZE)
    with SharedKV(layers, block_dim, BLOCK_SIZE) as shared:
        description = shared.description
        offsets = description.layout.layer_offsets_bytes
        assert len(set(offsets)) == 4 and offsets == sorted(offsets)
        assert offsets[-1] + layers[-1].nbytes <= description.file_bytes
        file = _map_file(description.path)
        for number, layer in enumerate(layers):
            raw = layer.contiguous().view(torch.uint8).numpy().tobytes()
            assert _layer_in_file(file, description, number).tobytes() == raw


def test_close_removes_the_name_and_the_tensors_keep_working():
    layers, block_dim = LAYOUTS["vllm_cpu"](num_layers=2, num_blocks=4, block_size=BLOCK_SIZE)
    shared = SharedKV(layers, block_dim, BLOCK_SIZE)
    path = shared.description.path
    shared.close()
    assert not os.path.exists(path)
    layers[0].fill_(2.0)
    assert torch.all(layers[0] == 2.0)


def test_the_worker_copy_engine_follows_the_move():
    layers, block_dim = LAYOUTS["vllm_cpu"](num_layers=2, num_blocks=8, block_size=BLOCK_SIZE)
    kv = PagedKV(layers, block_dim, BLOCK_SIZE)
    nbytes = 2 * kv.layer_block_bytes * 2
    pool = np.zeros(nbytes, dtype=np.uint8)
    kv.store_chunks(pool, [ChunkCopy(p.Slot(0, nbytes), [1, 2])])  # maps the old memory
    with SharedKV(layers, block_dim, BLOCK_SIZE):
        kv.load_chunks(pool, [ChunkCopy(p.Slot(0, nbytes), [6, 7])])  # must use the new memory
        assert blocks_of(layers, block_dim, [6, 7]) == blocks_of(layers, block_dim, [1, 2])
        assert reference_object(layers, block_dim, [6, 7]) == pool.tobytes()


def test_the_description_travels_as_msgpack_and_rejects_what_it_does_not_know():
    layers, block_dim = LAYOUTS["split_kv"](num_layers=2, num_blocks=4, block_size=BLOCK_SIZE)
    with SharedKV(layers, block_dim, BLOCK_SIZE) as shared:
        wire = msgspec.msgpack.encode(shared.description)
        assert msgspec.msgpack.decode(wire, type=SharedKVFile) == shared.description
        as_dict = msgspec.to_builtins(shared.description)
        with pytest.raises(msgspec.ValidationError, match="unknown field"):
            msgspec.convert({**as_dict, "extra": 1}, SharedKVFile)
        with pytest.raises(msgspec.ValidationError, match="reach byte"):
            msgspec.convert({**as_dict, "file_bytes": 64}, SharedKVFile)
        bad_layout = {**as_dict["layout"], "block_dim": 9}
        with pytest.raises(msgspec.ValidationError, match="block_dim 9"):
            msgspec.convert({**as_dict, "layout": bad_layout}, SharedKVFile)


def test_cuda_kv_is_refused():
    layers = (torch.zeros(4, 16, 8, device="meta"),)
    with pytest.raises(ValueError, match="only CPU"):
        SharedKV(layers, 0, BLOCK_SIZE)


@pytest.mark.vllm
def test_vllms_own_cpu_allocation_moves_and_its_bound_views_follow():
    """vLLM 0.32 allocates one buffer for all layers and binds views of it to the layers."""
    pytest.importorskip("vllm")
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    num_layers, num_blocks = 3, 10
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
    page = spec.page_size_bytes
    names = [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(
                size=num_layers * num_blocks * page,
                layers=names,
                layer_stride=num_blocks * page,
                block_stride=page,
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
    )
    kv_caches = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout.LBHNC)
    layers = tuple(kv_caches[name] for name in names)
    assert layers[0].shape == (num_blocks, 2, 32, 64)  # (blocks, heads, block_size, 2·head)
    for layer in layers:
        layer.copy_(torch.randn(layer.shape))
    bound = [layer.view(num_blocks, 2, 64, 32) for layer in layers]  # as the CPU backend reads
    contents = blocks_of(layers, 0, list(range(num_blocks)))
    with SharedKV(layers, 0, 32) as shared:
        assert blocks_of(layers, 0, list(range(num_blocks))) == contents
        file = _map_file(shared.description.path)
        offset = shared.description.layout.layer_offsets_bytes[2]
        file[offset + 4 * page : offset + 5 * page] = 0
        assert not bound[2][4].view(torch.uint8).any()
