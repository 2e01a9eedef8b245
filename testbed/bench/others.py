"""The benchmarks with no key in ``results.json``: their own tables, run as they always were.

Each runs as ``python -m testbed.bench.<name>`` in a process of its own with the sizes below
(smaller with ``--quick``) and its printed table goes into BENCHMARKS.md as it is: the
copy alone (``copies``: the data path's copies against memcpy, no round trips), the pool
allocator, eviction per policy, the what-if against the oracle runs it replaces, and a span's
cost per operation (the recorder against the SDK's provider).
"""

from __future__ import annotations

import subprocess
import sys

from testbed.bench.config import BenchConfig, SectionResult, Table, find_trace

FULL = {
    "copies": ["--rounds", "30"],
    "pool_allocator": ["--extents", "1000", "10000", "--pairs", "5000"],
    "eviction": ["--objects", "100000", "--batches", "5"],
    "whatif": ["--requests", "1000", "--rounds", "3"],
    "span_cost": ["--ops", "20000", "--rounds", "5"],
}
QUICK = {
    "copies": ["--rounds", "2", "--legacy-rounds", "0", "--tiny-batch", "4", "--no-llama"],
    "pool_allocator": ["--extents", "100", "--pairs", "200"],
    "eviction": ["--objects", "2000", "--batches", "2", "--batch", "100"],
    "whatif": ["--requests", "30", "--rounds", "1", "--chunk-sizes", "256,512"],
    "span_cost": ["--ops", "200", "--rounds", "1"],
}


def section(config: BenchConfig) -> SectionResult:
    tables = []
    for name, args in (QUICK if config.quick else FULL).items():
        if name == "whatif":
            args = [*args, "--trace", str(find_trace(config))]
        command = [sys.executable, "-m", f"testbed.bench.{name}", *args]
        print(f"  others: {name}", file=sys.stderr, flush=True)
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command[1:])} failed: {done.stderr.strip()[-500:]}")
        tables.append(
            Table(
                name,
                ("output",),
                [],
                f"`python -m testbed.bench.{name} "
                f"{' '.join(args)}`\n\n```\n{done.stdout.strip()}\n```",
            )
        )
    return SectionResult([], tables)
