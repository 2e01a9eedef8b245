"""Analysis of runs: span files → pandas DataFrames → metrics, tables and figures.

Notebooks and reports call only this package. See METRICS.md for the definition of every
metric computed here.
"""

from testbed.analysis import metrics, plots, tables
from testbed.analysis.spans import load_events, load_spans
from testbed.analysis.tables import (
    Run,
    compare_to_oracle,
    load_run,
    load_sweep_index,
    requests_table,
)

__all__ = [
    "Run",
    "compare_to_oracle",
    "load_events",
    "load_run",
    "load_spans",
    "load_sweep_index",
    "metrics",
    "plots",
    "requests_table",
    "tables",
]
