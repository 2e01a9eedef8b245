"""Data path at memory speed: store and retrieve copies against memcpy of the same bytes.

One 256-token chunk of a Llama-3-8B-shaped KV (32 layers × K/V × 8 heads × 128 × fp16: 32 MiB)
and of the ``tiny`` profile (32 KiB; and a batch of 64 of its chunks), in vLLM's CPU layout
(one allocation, per layer ``(num_blocks, heads, block_size, 2·head_dim)``), the blocks of a
chunk picked at random among four chunks' worth. Every round runs every case once, in a
shuffled order, so machine noise hits all alike:

- ``memcpy``: one ``numpy.copyto`` of the object's bytes (KV → pool, and back): the baseline;
- ``worker``: ``PagedKV.store_chunks`` / ``load_chunks`` on heap KV tensors (worker mode);
- ``server``: ``server.kv_copier.EngineKV`` on the same shape of KV moved into shared memory
  by ``connector.shared_kv``, numpy only (server mode);
- ``torch/layer``: the previous engine, one ``index_select`` / ``index_copy_`` per layer, at
  one torch thread and at torch's default (all cores), for reference (in the first
  ``--legacy-rounds`` rounds only: with a busy neighbour one call can take seconds).

The pool is a pre-faulted ``SharedMemoryPool``. ``× memcpy`` is the memcpy median of the same
direction over the case's median (1.0: as fast as memcpy). With ``--busy`` a busy loop runs
on the other core (this process and the loop are pinned apart).

    python -m testbed.bench.copies [--rounds 200] [--busy] [--copy-threads 1]
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from connector.kv_copy import PagedKV
from connector.shared_kv import SharedKV
from server.kv_copier import EngineKV
from server.pool import SharedMemoryPool
from testbed.bench.tables import table
from testbed.core import protocol as p
from testbed.core.block_copy import ChunkCopy
from testbed.models.profiles import KVProfile, get_profile

CHUNK_TOKENS = 256
MODE_ORDER = ["memcpy", "worker", "server", "torch/layer"]


@dataclass
class Case:
    profile: KVProfile
    num_chunks: int
    layers: tuple[torch.Tensor, ...]
    worker: PagedKV
    shared_layers: tuple[torch.Tensor, ...]
    shared: SharedKV
    server: EngineKV
    pool: SharedMemoryPool
    blocks_per_chunk: int
    object_bytes: int

    @property
    def name(self) -> str:
        chunks = f"{self.num_chunks}×" if self.num_chunks > 1 else ""
        return f"{self.profile.name} {chunks}{CHUNK_TOKENS} tokens ({_size(self.total_bytes)})"

    @property
    def total_bytes(self) -> int:
        return self.object_bytes * self.num_chunks


def vllm_cpu_kv(profile: KVProfile, num_blocks: int, block_size: int) -> tuple[torch.Tensor, ...]:
    """Per-layer views of one fp16 allocation, as vLLM 0.32's CPU backend makes them."""
    heads, content = profile.num_kv_heads, 2 * profile.head_dim
    shape = (profile.num_layers, num_blocks, heads, block_size, content)
    raw = torch.randint(-(1 << 15), 1 << 15, shape, dtype=torch.int16)
    return tuple(raw.view(torch.float16)[layer] for layer in range(profile.num_layers))


def make_case(profile: KVProfile, num_chunks: int, block_size: int, copy_threads: int) -> Case:
    blocks_per_chunk = CHUNK_TOKENS // block_size
    num_blocks = 4 * blocks_per_chunk * num_chunks
    layers = vllm_cpu_kv(profile, num_blocks, block_size)
    shared_layers = vllm_cpu_kv(profile, num_blocks, block_size)
    shared = SharedKV(shared_layers, 0, block_size)
    worker = PagedKV(layers, 0, block_size, num_copy_threads=copy_threads)
    object_bytes = worker.layer_block_bytes * len(layers) * blocks_per_chunk
    pool = SharedMemoryPool(object_bytes * num_chunks + (1 << 20))
    return Case(
        profile,
        num_chunks,
        layers,
        worker,
        shared_layers,
        shared,
        EngineKV(shared.description, num_threads=copy_threads),
        pool,
        blocks_per_chunk,
        object_bytes,
    )


def operations(case: Case, rng: random.Random) -> dict[tuple[str, str], Callable[[], object]]:
    """One round's calls, each on freshly drawn blocks."""
    num_blocks = case.layers[0].shape[0]
    blocks = rng.sample(range(num_blocks), 2 * case.blocks_per_chunk * case.num_chunks)
    stores, loads = [], []
    for chunk in range(case.num_chunks):
        slot = p.Slot(chunk * case.object_bytes, case.object_bytes)
        ids = blocks[chunk * case.blocks_per_chunk : (chunk + 1) * case.blocks_per_chunk]
        other = blocks[(case.num_chunks + chunk) * case.blocks_per_chunk :][: case.blocks_per_chunk]
        stores.append(ChunkCopy(slot, ids))
        loads.append(ChunkCopy(slot, other))
    pool = case.pool.array
    flat_kv = case.layers[0].untyped_storage()
    kv_bytes = torch.empty(0, dtype=torch.uint8).set_(flat_kv).numpy()[: case.total_bytes]
    pool_bytes = pool[: case.total_bytes]
    return {
        ("store", "memcpy"): lambda: np.copyto(pool_bytes, kv_bytes),
        ("retrieve", "memcpy"): lambda: np.copyto(kv_bytes, pool_bytes),
        ("store", "worker"): lambda: case.worker.store_chunks(pool, stores),
        ("retrieve", "worker"): lambda: case.worker.load_chunks(pool, loads),
        ("store", "server"): lambda: case.server.store(pool, stores),
        ("retrieve", "server"): lambda: case.server.retrieve(pool, loads),
    }


def torch_per_layer(
    case: Case, rng: random.Random, threads: int
) -> dict[tuple[str, str], Callable]:
    """The previous engine (one index_select / index_copy_ per layer), for reference."""
    num_blocks = case.layers[0].shape[0]
    ids = torch.tensor(rng.sample(range(num_blocks), case.blocks_per_chunk))
    pool = torch.from_numpy(case.pool.array)
    per_layer = case.object_bytes // len(case.layers)
    shape = (case.blocks_per_chunk, *case.layers[0].shape[1:])
    views = [
        pool[i * per_layer : (i + 1) * per_layer].view(torch.float16).view(shape)
        for i in range(len(case.layers))
    ]

    def store() -> None:
        for layer, view in zip(case.layers, views, strict=True):
            torch.index_select(layer, 0, ids, out=view)

    def retrieve() -> None:
        for layer, view in zip(case.layers, views, strict=True):
            layer.index_copy_(0, ids, view)

    mode = f"torch/layer {threads}t"
    return {("store", mode): store, ("retrieve", mode): retrieve}


def run(cases: list[Case], rounds: int, legacy_rounds: int, seed: int) -> dict:
    rng = random.Random(seed)
    default_threads = torch.get_num_threads()
    samples: dict[tuple[str, str, str], list[float]] = {}
    for round_number in range(rounds + 2):  # two warm-up rounds, not recorded
        calls = []
        for case in cases:
            ops = operations(case, rng)
            if round_number < legacy_rounds + 2 and case.num_chunks == 1:
                for threads in sorted({1, default_threads}):
                    ops |= torch_per_layer(case, rng, threads)
            calls += [(case.name, direction, mode, fn) for (direction, mode), fn in ops.items()]
        rng.shuffle(calls)
        gc.collect()
        gc.disable()
        for name, direction, mode, fn in calls:
            # Outside the timing: only the torch/layer rows depend on it.
            torch.set_num_threads(1 if mode == "torch/layer 1t" else default_threads)
            started = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - started
            if round_number >= 2:
                samples.setdefault((name, direction, mode), []).append(elapsed)
        gc.enable()
    torch.set_num_threads(default_threads)
    return samples


def report(cases: list[Case], samples: dict, rounds: int, busy: bool, threads: int) -> None:
    rows = []
    for case in cases:
        for direction in ("store", "retrieve"):
            baseline = statistics.median(samples[(case.name, direction, "memcpy")])
            modes = {m for (n, d, m) in samples if n == case.name and d == direction}
            for mode in sorted(modes, key=lambda m: (MODE_ORDER.index(m.split()[0]), m)):
                values = sorted(samples[(case.name, direction, mode)])
                median = statistics.median(values)
                p99 = values[min(len(values) - 1, int(0.99 * len(values)))]
                rows.append(
                    (
                        case.name,
                        direction,
                        mode,
                        f"{median * 1e3:.3f}",
                        f"{p99 * 1e3:.3f}",
                        f"{case.total_bytes / median / 1e9:.2f}",
                        f"{baseline / median:.2f}",
                        f"{p99 / median:.2f}",
                    )
                )
    print(
        f"data path copies, {rounds} interleaved rounds, copy threads {threads}, "
        f"torch default threads {torch.get_num_threads()}, busy loop: {'yes' if busy else 'no'}"
    )
    header = ("case", "op", "mode", "p50 ms", "p99 ms", "GB/s", "× memcpy", "p99/p50")
    print(table(rows, header))


def start_busy_loop() -> subprocess.Popen | None:
    """A busy loop pinned to another core than this process (which is pinned to one)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        print("only one core: no busy loop", file=sys.stderr)
        return None
    os.sched_setaffinity(0, {cores[0]})
    loop = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    os.sched_setaffinity(loop.pid, {cores[1]})
    time.sleep(0.2)
    return loop


def _size(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.0f} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--busy", action="store_true", help="busy loop on the other core")
    parser.add_argument("--block-size", type=int, default=32, help="vLLM's CPU default")
    parser.add_argument("--copy-threads", type=int, default=1)
    parser.add_argument("--tiny-batch", type=int, default=64, help="chunks in the batch case")
    parser.add_argument(
        "--legacy-rounds",
        type=int,
        default=20,
        help="rounds that also time the torch/layer rows (slow with many threads); 0: none",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-llama", action="store_true", help="only the tiny profile's chunks (quick runs)"
    )
    args = parser.parse_args()
    cases = (
        []
        if args.no_llama
        else [make_case(get_profile("llama3-8b"), 1, args.block_size, args.copy_threads)]
    )
    cases.append(make_case(get_profile("tiny"), 1, args.block_size, args.copy_threads))
    if args.tiny_batch > 1:
        cases.append(
            make_case(get_profile("tiny"), args.tiny_batch, args.block_size, args.copy_threads)
        )
    prefault_s = [case.pool.prefault() for case in cases]
    print(
        "pool prefault: "
        + ", ".join(
            f"{_size(case.pool.size)} in {s * 1e3:.1f} ms"
            for case, s in zip(cases, prefault_s, strict=True)
        )
    )
    loop = start_busy_loop() if args.busy else None
    try:
        samples = run(cases, args.rounds, min(args.legacy_rounds, args.rounds), args.seed)
    finally:
        if loop is not None:
            loop.kill()
            loop.wait()
        for case in cases:
            case.server.close()
            case.shared.close()
            case.worker.close()
            case.pool.close()
    report(cases, samples, args.rounds, args.busy, args.copy_threads)


if __name__ == "__main__":
    main()
