"""Every benchmark still runs against today's code, at the smallest sizes (speeds are the
benchmarks' business and asserted nowhere; this only keeps them from rotting). The vLLM
end-to-end benchmark starts three vLLM engines, too long for the suite; mypy checks it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SMALL = {
    "benchmarks.tracing_overhead": (["--rounds", "3"], "tracing overhead per operation"),
    "benchmarks.loader": (["--spans", "2000"], "spans/s"),
    "benchmarks.replay_throughput": (["--requests", "20"], "integrity errors"),
    "benchmarks.data_path": (["--rounds", "2"], "× memcpy"),
    "benchmarks.pool_allocator": (["--extents", "100", "--pairs", "200"], "µs per pair"),
    "benchmarks.eviction": (["--objects", "2000", "--batches", "2", "--batch", "100"], "vs lru"),
    "benchmarks.whatif": (["--requests", "50", "--rounds", "1"], "oracle points that differ"),
}


@pytest.mark.parametrize("module", sorted(SMALL))
def test_the_benchmark_runs_and_prints_its_table(module):
    args, expected = SMALL[module]
    done = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert expected in done.stdout


def test_the_benchmark_command_runs_each_of_these():
    from benchmarks.__main__ import BENCHMARKS

    listed = {module for module, *_ in BENCHMARKS}
    assert set(SMALL) <= listed and listed - set(SMALL) == {"benchmarks.vllm_e2e"}
