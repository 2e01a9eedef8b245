"""Analysis of runs: span files → pandas DataFrames → metrics, tables and figures.

Notebooks and reports call only this package. See METRICS.md for the definition of every
metric computed here.
"""

from testbed.analysis.spans import load_events, load_spans

__all__ = ["load_events", "load_spans"]
