"""The GPU data path against the device's own copies, and the H200 calibration, in one run.

Needs a CUDA device (``scripts/gpu_check.sh`` runs it on one). A separate worker process
(``testbed.engine.cuda_worker export``) allocates Llama-3-8B-shaped paged KV as vLLM does on a
GPU (32 layers, 8 KV heads of 128, bf16, 16-token blocks: 32 MiB per 256-token chunk) and
exports it through CUDA IPC; this process opens it with the server's own engine
(``server.cuda_engine.CudaEngineKV``) and pools (``server.pools``), as the cache server does.

Bandwidth: per pool (``pinned-host``, ``gpu``), a batch of ``--chunks`` chunks whose blocks lie
at random in the KV, stored into back-to-back slots (as the server allocates a batch) and
retrieved into other blocks; interleaved with them, every round, the device's own copy of the
same bytes between one contiguous device tensor and the same pool region (D2H and H2D for
pinned host, D2D for GPU memory). All on the engine's stream, timed with CUDA events; medians.
``ratio`` = the device copy's time over the operation's (1.0: as fast as a plain copy).

Calibration: prefill times of a random-weight Llama-3-8B (``testbed.bench.gpu_prefill``) at a few
prompt lengths, the load time of the same tokens' KV from each pool (the server's copy into
the engine's blocks), and the H200 profile's measured figures fitted to them
(``testbed.models.calibration``), written as ``h200_calibration.toml``.

    python -m testbed.bench.gpu_data_path --out DIR [--chunks 8] [--rounds 20]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import torch

from server.cuda_engine import CudaEngineKV
from server.pools import make_pool
from testbed.bench.gpu_prefill import RandomLlama, prefill_ms
from testbed.bench.tables import table
from testbed.core import protocol as p
from testbed.core.block_runs import ChunkCopy
from testbed.models.calibration import calibrate, calibration_toml
from testbed.models.hardware import HARDWARE, Hardware
from testbed.models.profiles import get_profile

CHUNK_TOKENS = 256
BLOCK_SIZE = 16


def _timed_ms(stream: torch.cuda.Stream, work: Callable[[], object]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    with torch.cuda.stream(stream):
        work()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end)


def _copies(
    num_blocks: int, chunks: int, object_bytes: int, rng: random.Random
) -> tuple[list[ChunkCopy], list[ChunkCopy]]:
    per_chunk = CHUNK_TOKENS // BLOCK_SIZE
    ids = rng.sample(range(num_blocks), 2 * chunks * per_chunk)
    slots = [p.Slot(i * object_bytes, object_bytes) for i in range(chunks)]
    store = [ChunkCopy(s, ids[i * per_chunk : (i + 1) * per_chunk]) for i, s in enumerate(slots)]
    rest = ids[chunks * per_chunk :]
    load = [ChunkCopy(s, rest[i * per_chunk : (i + 1) * per_chunk]) for i, s in enumerate(slots)]
    return store, load


def bandwidth(description: p.CudaKV, kind: str, chunks: int, rounds: int, capacity: int) -> dict:
    """Store and retrieve of one batch against the device's copies of the same bytes."""
    pool = make_pool(kind, capacity)  # type: ignore[arg-type]
    engines = {16: CudaEngineKV(description), 8: CudaEngineKV(description, max_width=8)}
    engine = engines[16]
    object_bytes = CHUNK_TOKENS * description.layout.bytes_per_token
    store, load = _copies(description.layout.num_blocks, chunks, object_bytes, random.Random(0))
    nbytes = chunks * object_bytes
    device_buffer = torch.empty(nbytes, dtype=torch.uint8, device=engine.device).random_()
    region = pool.tensor[:nbytes]
    cases: dict[str, Callable[[], object]] = {
        "device copy out": lambda: region.copy_(device_buffer, non_blocking=True),
        "store": lambda: engine.store(pool.tensor, store),
        "device copy in": lambda: device_buffer.copy_(region, non_blocking=True),
        "retrieve": lambda: engine.retrieve(pool.tensor, load),
        "store (8-byte elements)": lambda: engines[8].store(pool.tensor, store),
    }
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds + 1):  # the first round warms up
        for name, work in cases.items():
            samples[name].append(_timed_ms(engine.stream, work))
    medians = {name: statistics.median(times[1:]) for name, times in samples.items()}
    result = {
        "pool": kind,
        "bytes": nbytes,
        "median_ms": medians,
        "gb_per_s": {name: nbytes / ms / 1e6 for name, ms in medians.items()},
        "store_ratio": medians["device copy out"] / medians["store"],
        "retrieve_ratio": medians["device copy in"] / medians["retrieve"],
        "engine_width_bytes": engine._live_copier().width,
    }
    for each in engines.values():
        each.close()
    pool.close()
    return result


def load_ms(
    description: p.CudaKV, kind: str, lengths: list[int], capacity: int
) -> list[tuple[int, float]]:
    """Per prompt length, the engine's copy of that many tokens' KV from the pool."""
    pool = make_pool(kind, capacity)  # type: ignore[arg-type]
    engine = CudaEngineKV(description)
    object_bytes = CHUNK_TOKENS * description.layout.bytes_per_token
    points = []
    for n in lengths:
        _, load = _copies(
            description.layout.num_blocks, n // CHUNK_TOKENS, object_bytes, random.Random(n)
        )

        def work(copies: list[ChunkCopy] = load) -> int:
            return engine.retrieve(pool.tensor, copies)

        times = [_timed_ms(engine.stream, work) for _ in range(4)][1:]  # the first warms up
        points.append((n, statistics.median(times)))
    engine.close()
    pool.close()
    return points


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    results = _measure_pools(args.chunks, args.rounds, args.lengths)
    model = RandomLlama(torch.device("cuda", 0), num_layers=args.model_layers)
    results["prefill_ms"] = prefill_ms(model, args.lengths)
    results["model_layers_run"] = args.model_layers
    del model
    measured = _calibrate_h200(results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_bench.json").write_text(json.dumps(results, indent=2))
    (args.out / "h200_calibration.toml").write_text(calibration_toml(measured))
    _print(results)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m testbed.bench.gpu_data_path")
    parser.add_argument("--out", type=Path, required=True, help="directory for the results")
    parser.add_argument("--chunks", type=int, default=8, help="chunks per operation")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    parser.add_argument("--model-layers", type=int, default=32, help="layers run (scaled to 32)")
    return parser


def _measure_pools(chunks: int, rounds: int, lengths: list[int]) -> dict[str, Any]:
    """Per pool, :func:`bandwidth` and :func:`load_ms` against KV exported by a worker process
    of its own (blocks and pool capacity for the longest of ``lengths`` or ``chunks`` chunks,
    whichever is larger); with the device's name and torch's version."""
    longest = max(lengths)
    num_blocks = 2 * max(longest, chunks * CHUNK_TOKENS) // BLOCK_SIZE
    capacity = max(longest, chunks * CHUNK_TOKENS) * get_profile("llama3-8b").bytes_per_token()
    command = ["-m", "testbed.engine.cuda_worker", "export", "--num-blocks", str(num_blocks)]
    worker = subprocess.Popen(
        [sys.executable, *command],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert worker.stdout is not None
        description = msgspec.json.decode(worker.stdout.readline(), type=p.CudaKV)
        results: dict[str, Any] = {
            "device": torch.cuda.get_device_name(0),
            "torch": torch.__version__,
            "bandwidth": [],
            "loads_ms": {},
        }
        for kind in ("pinned-host", "gpu"):
            results["bandwidth"].append(bandwidth(description, kind, chunks, rounds, capacity))
            results["loads_ms"][kind] = load_ms(description, kind, lengths, capacity)
    finally:
        if worker.stdin is not None:
            worker.stdin.close()
        worker.wait(timeout=60)
    return results


def _calibrate_h200(results: dict[str, Any]) -> Hardware:
    """The H200 profile fitted to ``results``' prefill times and pinned-host loads; adds its
    measured figures to ``results`` as ``h200_measured``."""
    source = (
        f"{results['device']}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}: "
        "python -m testbed.bench.gpu_data_path"
    )
    measured = calibrate(
        HARDWARE["h200"],
        get_profile("llama3-8b"),
        results["prefill_ms"],
        results["loads_ms"]["pinned-host"],
        source,
    )
    results["h200_measured"] = msgspec.to_builtins(
        {
            k: getattr(measured, k)
            for k in (
                "measured_compute_efficiency",
                "measured_load_bytes_per_s",
                "measured_load_latency_s",
            )
        }
    )
    return measured


def _print(results: dict) -> None:
    rows = []
    for entry in results["bandwidth"]:
        for name, rate in entry["gb_per_s"].items():
            rows.append([entry["pool"], name, f"{entry['median_ms'][name]:.3f}", f"{rate:.1f}"])
        rows.append(
            [
                entry["pool"],
                "ratio store / retrieve",
                f"{entry['store_ratio']:.2f}",
                f"{entry['retrieve_ratio']:.2f}",
            ]
        )
    print(table(rows, ["pool", "case", "median ms", "GB/s"]))
    loads = results["loads_ms"]
    rows = [
        [n, f"{ms:.1f}", f"{loads['pinned-host'][i][1]:.2f}", f"{loads['gpu'][i][1]:.2f}"]
        for i, (n, ms) in enumerate(results["prefill_ms"])
    ]
    print(table(rows, ["prompt tokens", "prefill ms", "load ms pinned-host", "load ms gpu"]))
    print("h200 measured:", results["h200_measured"])


if __name__ == "__main__":
    sys.exit(main())
