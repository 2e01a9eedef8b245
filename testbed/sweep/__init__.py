"""Sweeps: TOML grids of runs, executed locally or on Ray, resumable, with an index of results.

:func:`load_sweep` reads and expands a sweep file (:mod:`.spec`), :func:`run_sweep` runs what
is missing of it (:mod:`.executors`, :mod:`.cli`), :func:`load_index` gives one row per run
(:mod:`.index`). ``kvtb sweep FILE`` and ``kvtb demo`` are the command-line faces.
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
