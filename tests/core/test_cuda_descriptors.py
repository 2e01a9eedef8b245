"""CUDA IPC descriptors without a GPU: built from the KV's layout, carried by the real protocol
structs, decoded by a real server, which refuses what it cannot serve and keeps serving.

The storages here are CPU storages exported by a stand-in for ``_share_cuda_`` (the one part
that needs a device); everything else is the code a GPU run uses. ``tests/gpu`` runs the real
export and the server's opening of it on a CUDA device.
"""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest
import torch

from connector.cuda_ipc import describe_cuda_kv
from connector.kv_copy import PagedKV
from testbed.core import protocol as p
from testbed.core.block_copy import ChunkCopy
from testbed.core.rpc import RemoteError
from testbed.core.torch_block_copy import TorchBlockCopier
from tests.support.cache_harness import connect
from tests.support.paged_kv import LAYOUTS, reference_object

BLOCK_SIZE = 16
UUID = "GPU-00000000-1111-2222-3333-444444444444"


class Exporter:
    """Exports CPU storages as a GPU would (a made-up handle per storage), remembering which
    storage each handle names so that the 'server' below can open it again."""

    def __init__(self) -> None:
        self.opened: dict[bytes, torch.UntypedStorage] = {}

    def __call__(self, storage: torch.UntypedStorage) -> p.CudaStorage:
        handle = len(self.opened).to_bytes(64, "little")
        self.opened[handle] = storage
        return p.CudaStorage(
            device_uuid=UUID, ipc_handle=handle, storage_bytes=storage.nbytes(), offset_bytes=0
        )


def _register(kv: p.CudaKV) -> bytes:
    return p.encode(
        p.RegisterWorker(model="m", world_size=1, kv_rank=0, layout=_kv_layout(kv), cuda_kv=kv)
    )


def _kv_layout(kv: p.CudaKV) -> p.KVLayout:
    layout = kv.layout
    return p.KVLayout(
        num_layers=layout.num_layers,
        block_size=layout.block_size,
        bytes_per_token=layout.bytes_per_token,
    )


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_decoded_description_locates_every_block_of_every_layer(layout):
    layers, block_dim = LAYOUTS[layout](num_layers=3, num_blocks=20, block_size=BLOCK_SIZE)
    exporter = Exporter()
    description = describe_cuda_kv(PagedKV(layers, block_dim, BLOCK_SIZE), exporter)
    distinct = {layer.untyped_storage().data_ptr() for layer in layers}
    assert len(description.storages) == len(distinct)  # each storage exported once

    decoded = p.decode_request(_register(description))
    assert isinstance(decoded, p.RegisterWorker) and decoded.cuda_kv == description
    # Open the storages as the server does (by handle) and copy through the description only:
    # the physical layout it carries (strides, offsets, shared storages) must find the blocks.
    kv = decoded.cuda_kv
    views = [
        torch.empty(0, dtype=torch.uint8).set_(exporter.opened[s.ipc_handle]) for s in kv.storages
    ]
    copier = TorchBlockCopier(kv.layout, [views[i] for i in kv.layer_storages])
    slot = p.Slot(0, 3 * copier.geometry.object_block_bytes)
    pool = torch.zeros(slot.nbytes, dtype=torch.uint8)
    copier.gather(pool, [ChunkCopy(slot, [17, 2, 9])])
    assert pool.numpy().tobytes() == reference_object(layers, block_dim, [17, 2, 9])


def test_events_travel_in_begins_and_plans():
    ready = p.CudaEvent(device_uuid=UUID, ipc_handle=bytes(range(64)))
    done = p.CudaEvent(device_uuid=UUID, ipc_handle=bytes(range(64, 128)))
    item = p.OpItem(session_id="s", chunk_hashes=[bytes(16)], block_ids=[1, 2])
    for begin in (
        p.StoreBegin(op_id=1, epoch=7, items=[item], ready_event=ready),
        p.RetrieveBegin(op_id=2, epoch=7, items=[item], ready_event=ready),
    ):
        assert p.decode_request(p.encode(begin)).ready_event == ready
    for plan in (
        p.StorePlan(op_id=1, items=[], copied=True, done_event=done),
        p.RetrievePlan(op_id=2, items=[], copied=True, done_event=done),
    ):
        assert p.decode_reply(p.encode(plan)).done_event == done


def test_descriptors_that_do_not_add_up_are_refused_when_decoded():
    layers, block_dim = LAYOUTS["vllm_cpu"](num_layers=2, num_blocks=8, block_size=BLOCK_SIZE)
    good = _register(_describe(layers, block_dim))
    edits = {
        "length >= 64": ("storages", 0, "ipc_handle", b"\0" * 63),
        "a layer reaches": ("storages", 0, "storage_bytes", 64),
        "layer storage 1": ("layer_storages", 1, None, 1),
    }
    for message, (field, index, key, value) in edits.items():
        wrong = msgspec.msgpack.decode(good)  # plain maps, to edit past the checks
        if key is None:
            wrong["cuda_kv"][field][index] = value
        else:
            wrong["cuda_kv"][field][index][key] = value
        with pytest.raises(msgspec.ValidationError) as refused:
            p.decode_request(msgspec.msgpack.encode(wrong))
        assert message in str(refused.value)


def _describe(layers: tuple[torch.Tensor, ...], block_dim: int) -> p.CudaKV:
    return describe_cuda_kv(PagedKV(layers, block_dim, BLOCK_SIZE), Exporter())


def test_a_server_without_cuda_refuses_cuda_kv_clearly_and_keeps_serving(start_server):
    server = start_server("--chunk-size", "64", "--capacity", "8MiB")
    layers, block_dim = LAYOUTS["separate"](num_layers=2, num_blocks=8, block_size=BLOCK_SIZE)
    kv = describe_cuda_kv(PagedKV(layers, block_dim, BLOCK_SIZE), Exporter())
    with connect(server, timeout_s=5.0) as rpc:
        register = p.decode_request(_register(kv))
        with pytest.raises(RemoteError) as refused:
            rpc.call(register)
        assert refused.value.code == "invalid"
        assert "--pool pinned-host or --pool gpu" in str(refused.value)
        assert isinstance(rpc.call(p.GetStats()), p.ServerStats)  # still serving


def test_cpu_pools_are_the_default_without_a_gpu_and_gpu_pools_are_refused_at_start(
    start_server,
):
    server = start_server("--chunk-size", "64", "--capacity", "8MiB")
    assert server.ready["pool_medium"] == "shm"
    for kind in ("gpu", "pinned-host"):
        done = subprocess.run(
            [sys.executable, "-m", "server", "--port", "0", "--pool", kind],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 2
        assert f"--pool {kind} needs a CUDA device" in done.stderr
