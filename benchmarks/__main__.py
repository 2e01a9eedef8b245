"""Runs every benchmark with small defaults: ``python -m benchmarks``."""

from __future__ import annotations

import subprocess
import sys

BENCHMARKS = [
    ["benchmarks.tracing_overhead", "--rounds", "100"],
    ["benchmarks.loader", "--spans", "100000"],
    ["benchmarks.replay_throughput", "--requests", "1000"],
    ["benchmarks.data_path", "--rounds", "30"],
    ["benchmarks.vllm_e2e", "--samples", "3", "--lengths", "1024", "4096"],
    ["benchmarks.pool_allocator", "--extents", "1000", "10000", "--pairs", "5000"],
    ["benchmarks.eviction", "--objects", "100000", "--batches", "5"],
    ["benchmarks.whatif", "--requests", "1000", "--rounds", "3"],
]

if __name__ == "__main__":
    status = 0
    for module, *args in BENCHMARKS:
        print(f"\n== {module} {' '.join(args)}", flush=True)
        status |= subprocess.call([sys.executable, "-m", module, *args])
    sys.exit(status)
