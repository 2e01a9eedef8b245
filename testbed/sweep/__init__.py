"""Sweeps: TOML grids of runs, executed locally or on Ray, resumable, with an index of results.

    sweep = load_sweep(Path("experiments/chunk_size.toml"))
    result = run_sweep(sweep, Path("runs"), SweepOptions(jobs=2))
    index = load_index(result.sweep_dir)   # one row per run: status, spec fields, summary fields
"""

from testbed.sweep.cli import SweepOptions, SweepResult, run_sweep
from testbed.sweep.index import build_index, load_index
from testbed.sweep.spec import SweepSpec, expand_sweep, load_sweep

__all__ = [
    "SweepOptions",
    "SweepResult",
    "SweepSpec",
    "build_index",
    "expand_sweep",
    "load_index",
    "load_sweep",
    "run_sweep",
]
