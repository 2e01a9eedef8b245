"""A model-less worker with paged KV on a GPU: the server-driven CUDA IPC path, checked end to end.

``python -m testbed.engine.cuda_worker SCENARIO --url URL --token TOKEN [...]`` runs in its
own process, as a vLLM worker does: it allocates Llama-shaped paged KV the way vLLM 0.32 does
on a GPU (one allocation, viewed per layer as ``(num_blocks, kv_heads, block_size,
2·head_dim)``), fills it with seeded random bytes, registers it with a real cache server through
:class:`connector.worker_client.WorkerClient` (CUDA IPC: the server maps the KV and copies) and
runs one scenario, printing one JSON line of results. The GPU tests (``tests/gpu``) and the GPU
benchmark (``testbed.bench.gpu_data_path``) drive it; ``probe`` checks that CUDA IPC works between
two processes at all (some sandboxes refuse it).

Scenarios: ``roundtrip`` (store, retrieve into other blocks with ``skip_first_n_tokens``, compare
bit for bit), ``ordering`` (the server's copies wait for the engine's events), ``mla`` (one
writer, another rank reads the same objects), ``hold`` (register, then wait to be killed),
``export`` (print the KV's CUDA IPC description, for the benchmark), ``probe``.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from connector.kv_copy import PagedKV
from connector.ops import RetrieveOp, StoreOp
from connector.worker_client import WorkerClient
from testbed.core import protocol as p
from testbed.core.keys import HASH_BYTES, ChunkHash
from testbed.core.ranks import WorkerIdentity
from testbed.core.rpc import RpcClient
from testbed.models.profiles import PROFILES

SLEEP_CYCLES = 200_000_000
"""``torch.cuda._sleep`` cycles queued before a write (~0.1 s): long enough that a copy which
does not wait for the engine's event runs before the write lands."""


_LLAMA3_8B = PROFILES["llama3-8b"]


@dataclass(frozen=True)
class Shape:
    """Paged KV of one TP rank (defaults: the ``llama3-8b`` profile's KV at TP 1, 256-token
    chunks of 16-token blocks)."""

    num_layers: int = _LLAMA3_8B.num_layers
    num_kv_heads: int = _LLAMA3_8B.num_kv_heads
    head_dim: int = _LLAMA3_8B.head_dim
    block_size: int = 16
    num_blocks: int = 1024
    dtype: torch.dtype = torch.bfloat16

    @property
    def page_bytes(self) -> int:
        return self.num_kv_heads * self.block_size * 2 * self.head_dim * self.dtype.itemsize


def paged_kv(shape: Shape, device: torch.device, seed: int = 0) -> PagedKV:
    """vLLM's GPU allocation: one int8 buffer, layer-major, one view per layer."""
    raw = torch.empty(shape.num_layers * shape.num_blocks * shape.page_bytes, dtype=torch.int8,
                      device=device)  # fmt: skip
    generator = torch.Generator(device=device).manual_seed(seed)
    raw.random_(-128, 127, generator=generator)
    per_layer = raw.view(shape.num_layers, shape.num_blocks, shape.num_kv_heads,
                         shape.block_size, 2 * shape.head_dim * shape.dtype.itemsize)  # fmt: skip
    layers = tuple(per_layer[layer].view(shape.dtype) for layer in range(shape.num_layers))
    return PagedKV(layers, 0, shape.block_size)


def blocks(kv: PagedKV, block_ids: list[int]) -> torch.Tensor:
    """The bytes of ``block_ids`` of every layer (a copy, on the device)."""
    index = torch.tensor(block_ids, device=kv.layers[0].device)
    return torch.stack([layer.index_select(0, index).view(torch.uint8) for layer in kv.layers])


def connect(url: str, token: str, role: str) -> RpcClient:
    return RpcClient(url, token=token, role=role, timeout_s=30.0)


def chunk_ops(
    kind: type[StoreOp] | type[RetrieveOp],
    block_ids: list[int],
    blocks_per_chunk: int,
    block_size: int,
    hashes: list[ChunkHash],
    **extra: Any,
) -> list[Any]:
    """One op per chunk, each its own request (as a batch of many requests' stores is)."""
    ops = []
    for index, chunk_hash in enumerate(hashes):
        ids = block_ids[index * blocks_per_chunk : (index + 1) * blocks_per_chunk]
        tokens = len(ids) * block_size
        ops.append(
            kind(
                request_id=f"r{index}",
                session_id=f"s{index}",
                cache_salt="",
                chunk_hashes=[chunk_hash],
                first_chunk=0,
                start_token=0,
                end_token=tokens,
                block_ids=ids,
                **extra,
            )  # fmt: skip
        )
    return ops


def retrieve(client: WorkerClient, ops: list[RetrieveOp], timeout_s: float = 30.0) -> set[int]:
    """Submits and completes ``ops`` (polling, as ``get_finished`` does); the failed blocks."""
    client.submit_retrieves(ops)
    failed: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while client.num_inflight_retrieves and time.monotonic() < deadline:
        failed |= client.complete_retrieves(wait_s=0.001).failed_block_ids
    if client.num_inflight_retrieves:
        raise TimeoutError("retrieves did not complete")
    return failed


class Worker:
    """One registered worker: its KV, its client, the chunk geometry."""

    def __init__(self, args: argparse.Namespace, kv_rank: int = 0, tp_rank: int = 0,
                 seed: int = 0) -> None:  # fmt: skip
        self.device = torch.device("cuda", args.device)
        self.shape = Shape(num_layers=args.num_layers, num_blocks=args.num_blocks)
        self.kv = paged_kv(self.shape, self.device, seed)
        mla = args.scenario == "mla"
        identity = WorkerIdentity.for_rank("bench-model", 2 if mla else 1, tp_rank, mla, "auto")
        self.client = WorkerClient(connect(args.url, args.token, f"w{tp_rank}"), identity)
        self.client.register(self.kv)
        self.per_chunk = self.client.blocks_per_chunk

    def hashes(self, count: int) -> list[ChunkHash]:
        return [ChunkHash(secrets.token_bytes(HASH_BYTES)) for _ in range(count)]

    def store(self, block_ids: list[int], hashes: list[ChunkHash]) -> bool:
        ops = chunk_ops(StoreOp, block_ids, self.per_chunk, self.shape.block_size, hashes)
        return self.client.store(ops, wait_s=30.0)

    def retrieve(
        self, block_ids: list[int], hashes: list[ChunkHash], skip_tokens: int = 0
    ) -> set[int]:
        ops = chunk_ops(RetrieveOp, block_ids, self.per_chunk, self.shape.block_size, hashes,
                        skip_first_n_tokens=skip_tokens)  # fmt: skip
        return retrieve(self.client, ops)

    def close(self) -> None:
        self.client.close()
        self.client.rpc.close()


def roundtrip(args: argparse.Namespace) -> dict[str, Any]:
    worker = Worker(args)
    n = args.chunks * worker.per_chunk
    source = list(range(n))
    target = list(range(n, 2 * n))
    hashes = worker.hashes(args.chunks)
    before = blocks(worker.kv, list(range(2 * n + 1)))
    stored = worker.store(source, hashes)
    skip = 3  # blocks of the first chunk the engine already holds
    failed = worker.retrieve(target, hashes, skip_tokens=skip * worker.shape.block_size)
    torch.cuda.synchronize()
    after = blocks(worker.kv, list(range(2 * n + 1)))
    result = {
        "stored": stored,
        "failed_blocks": len(failed),
        "bit_exact": bool(torch.equal(after[:, n + skip : 2 * n], before[:, skip:n])),
        "skipped_untouched": bool(torch.equal(after[:, n : n + skip], before[:, n : n + skip])),
        "others_untouched": bool(
            torch.equal(after[:, :n], before[:, :n])
            and torch.equal(after[:, 2 * n], before[:, 2 * n])
        ),  # fmt: skip
        "events_lent_after": worker.client.shared.events.num_lent,  # type: ignore[union-attr]
        "bytes": 2 * n * worker.shape.page_bytes * worker.shape.num_layers,
    }
    worker.close()
    return result


def ordering(args: argparse.Namespace) -> dict[str, Any]:
    """Writes queued behind a long kernel, then a store (must see them) and a retrieve into
    blocks the engine zeroes behind another (must land after the zeroing)."""
    worker = Worker(args)
    n = worker.per_chunk
    source, target = list(range(n)), list(range(n, 2 * n))
    hashes = worker.hashes(1)
    stream = torch.cuda.current_stream(worker.device)
    torch.cuda._sleep(SLEEP_CYCLES)
    source_index = torch.tensor(source, device=worker.device)
    for layer in worker.kv.layers:
        layer.view(torch.uint8).index_fill_(0, source_index, 0x5A)  # the forward pass, late
    stored = worker.store(source, hashes)
    written = blocks(worker.kv, source)
    torch.cuda._sleep(SLEEP_CYCLES)
    target_index = torch.tensor(target, device=worker.device)
    for layer in worker.kv.layers:
        layer.index_fill_(0, target_index, 0)  # blocks handed to the retrieve, being zeroed
    failed = worker.retrieve(target, hashes)
    stream.synchronize()
    loaded = blocks(worker.kv, target)
    result = {
        "stored": stored,
        "failed_blocks": len(failed),
        "store_saw_the_write": bool((written == 0x5A).all()),
        "retrieve_after_the_zeroing": bool(torch.equal(loaded, written)),
    }
    worker.close()
    return result


def mla(args: argparse.Namespace) -> dict[str, Any]:
    """MLA: rank 0 stores the one latent copy; rank 1 (its own KV, its own connection) loads
    it; the objects are named for KV rank 0 and world size 1."""
    writer = Worker(args, tp_rank=0, seed=1)
    reader = Worker(args, tp_rank=1, seed=2)
    n = args.chunks * writer.per_chunk
    hashes = writer.hashes(args.chunks)
    stored = writer.store(list(range(n)), hashes)
    failed = reader.retrieve(list(range(n, 2 * n)), hashes)
    torch.cuda.synchronize()
    same = torch.equal(blocks(reader.kv, list(range(n, 2 * n))), blocks(writer.kv, list(range(n))))
    writer.close()
    reader.close()
    return {"stored": stored, "failed_blocks": len(failed), "bit_exact": bool(same)}


def export(args: argparse.Namespace) -> dict[str, Any]:
    """Exports Llama-shaped KV (no server) and prints its description; keeps the KV alive
    until stdin closes (the GPU benchmark opens it as the server's engine does)."""
    from connector.cuda_ipc import CudaExport

    shape = Shape(num_layers=args.num_layers, num_blocks=args.num_blocks)
    kv = paged_kv(shape, torch.device("cuda", args.device))
    exported = CudaExport(kv)
    torch.cuda.synchronize()
    print(msgspec.json.encode(exported.description).decode(), flush=True)
    sys.stdin.read()
    return {"exported_bytes": shape.num_layers * shape.num_blocks * shape.page_bytes}


def hold(args: argparse.Namespace) -> dict[str, Any]:
    """Registers, says so, and waits to be killed (the server must drop the dead worker)."""
    worker = Worker(args)
    print(json.dumps({"scenario": "hold", "registered": True}), flush=True)
    del worker
    while True:
        time.sleep(1.0)


class ProbePayload(msgspec.Struct):
    """What the probe's exporter hands its child: a storage and an event to open."""

    storage: p.CudaStorage
    event: p.CudaEvent


def probe(args: argparse.Namespace) -> dict[str, Any]:
    """CUDA IPC between two processes: this one exports a tensor and an event, a child opens
    both, waits on the event and sums the tensor."""
    from connector.cuda_ipc import ReadyEvents, share_storage

    device = torch.device("cuda", args.device)
    tensor = torch.arange(1 << 20, dtype=torch.int64, device=device)
    events = ReadyEvents(device)
    _, event = events.record()
    storage = share_storage(tensor.untyped_storage())
    payload = msgspec.json.encode(ProbePayload(storage, event)).decode()
    child = subprocess.run(
        [sys.executable, "-m", "testbed.engine.cuda_worker", "probe-open", "--device",
         str(args.device)], input=payload, capture_output=True, text=True, timeout=120,
        check=False,
    )  # fmt: skip
    expected = int(tensor.sum())
    got = child.stdout.strip().splitlines()[-1] if child.stdout.strip() else ""
    return {"ipc_works": got == str(expected), "child_stderr": child.stderr[-2000:]}


def probe_open(args: argparse.Namespace) -> None:
    from server.cuda_engine import open_storage

    payload = msgspec.json.decode(sys.stdin.read(), type=ProbePayload)
    opened = open_storage(payload.storage, args.device)
    event = torch.cuda.Event.from_ipc_handle(args.device, payload.event.ipc_handle)
    torch.cuda.current_stream(args.device).wait_event(event)
    view = torch.empty(0, dtype=torch.int64, device=torch.device("cuda", args.device))
    print(int(view.set_(opened).sum()), flush=True)


SCENARIOS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "roundtrip": roundtrip,
    "ordering": ordering,
    "mla": mla,
    "probe": probe,
    "hold": hold,
    "export": export,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbed.engine.cuda_worker")
    parser.add_argument("scenario", choices=[*SCENARIOS, "probe-open"])
    parser.add_argument("--url", default="")
    parser.add_argument("--token", default="", help="the server's client token")
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--num-layers", type=int, default=Shape.num_layers)
    parser.add_argument("--num-blocks", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=4)
    args = parser.parse_args(argv)
    if args.scenario == "probe-open":
        probe_open(args)
        return 0
    result = SCENARIOS[args.scenario](args)
    print(json.dumps({"scenario": args.scenario, "pid": os.getpid(), **result}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
