"""Analysis of runs: span files → pandas DataFrames → metrics, tables and figures.

Notebooks and reports call only this package. See METRICS.md for the definition of every
metric computed here. The per-request table is :attr:`Run.requests` (``metrics.parquet``);
:func:`open_source` opens a run, a sweep or a directory of runs as one table of runs.
"""

from testbed.analysis import metrics, plots, tables
from testbed.analysis.source import SOURCE_ENV, Source, open_source
from testbed.analysis.spans import load_events, load_spans
from testbed.analysis.tables import (
    Run,
    compare_to_oracle,
    load_run,
    load_sweep_index,
    request_spans,
)

__all__ = [
    "SOURCE_ENV",
    "Run",
    "Source",
    "compare_to_oracle",
    "load_events",
    "load_run",
    "load_spans",
    "load_sweep_index",
    "metrics",
    "open_source",
    "plots",
    "request_spans",
    "tables",
]
