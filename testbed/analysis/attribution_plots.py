"""Where every prompt token went, per run: the stacked figure and the table of miss causes.

The figure stacks the categories of :mod:`testbed.analysis.attribution` (shares of the
prompt tokens); the table is the 3C table of cache studies, for KV reuse: ``cold`` is the
compulsory miss, ``capacity`` the capacity miss, there are no conflict misses (the cache is
fully associative), and the other causes are particular to a KV cache behind an engine.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib import pyplot as plt
from matplotlib.figure import Figure

from testbed.analysis.attribution import CATEGORIES, MISS_CAUSES, attribution, token_causes
from testbed.analysis.tables import Run

COLORS = {
    "engine": "tab:blue",
    "external": "tab:green",
    "cold": "tab:gray",
    "capacity": "tab:red",
    "partial_chunk": "tab:olive",
    "last_token": "black",
    "load_failed": "tab:purple",
    "in_flight": "tab:orange",
    "unavailable": "tab:brown",
    "engine_only": "tab:cyan",
    "routing": "tab:pink",
}
LABELS = {
    "engine": "engine (vLLM prefix cache)",
    "external": "external (cache server)",
    "cold": "cold",
    "capacity": "capacity",
    "partial_chunk": "partial chunk",
    "last_token": "last token",
    "load_failed": "load failed",
    "in_flight": "in flight",
    "unavailable": "unavailable",
    "engine_only": "engine only",
    "routing": "routing (held by another instance)",
}


def tokens_by_run(run_dirs: Mapping[str, Path]) -> pd.DataFrame:
    """One row per run (``label``, then every category): summary.json's ``tokens`` table when
    the run has one, else computed from its telemetry. Runs without connector request spans
    (the oracle, runs made before the accounting spans existed) are left out."""
    rows = []
    for label, path in run_dirs.items():
        tokens = _tokens(Run(Path(path)))
        if tokens is not None:
            rows.append({"label": label, **tokens})
    return pd.DataFrame(rows, columns=["label", *CATEGORIES])


def where_tokens_went(table: pd.DataFrame, label: str, title: str) -> Figure:
    """Stacked bars, one per row of ``table``: each category's share of the prompt tokens
    (every category in the legend, in the order of METRICS.md)."""
    figure, axes = plt.subplots(figsize=(max(8.0, 0.9 * len(table) + 4), 5.5), layout="constrained")
    axes.set_title(textwrap.fill(title, 70))
    axes.grid(True, axis="y", alpha=0.3)
    positions = np.arange(len(table))
    values = table[list(CATEGORIES)].astype(float).to_numpy()
    shares = 100 * values / np.maximum(values.sum(axis=1, keepdims=True), 1)
    bottom = np.zeros(len(table))
    for index, name in enumerate(CATEGORIES):  # all in the legend, also those that are 0
        axes.bar(positions, shares[:, index], bottom=bottom, color=COLORS[name], label=LABELS[name])
        bottom += shares[:, index]
    axes.set_xticks(positions, table[label].astype(str), rotation=30, ha="right")
    axes.set_ylabel("share of prompt tokens (%)")
    axes.set_ylim(0, 100)
    axes.legend(fontsize="small", loc="center left", bbox_to_anchor=(1.0, 0.5))
    return figure


def miss_cause_table(table: pd.DataFrame, label: str = "label") -> pd.DataFrame:
    """Per run: prompt tokens, tokens the engine computed (``missed``, share of the prompt),
    and each miss cause as tokens with its share of the missed tokens."""
    rows = []
    for row in table.itertuples(index=False):
        values = row._asdict()
        prompt = sum(int(values[name]) for name in CATEGORIES)
        missed = sum(int(values[name]) for name in MISS_CAUSES)
        cells = {
            "run": values[label],
            "prompt tokens": f"{prompt:,}",
            "missed": f"{missed:,} ({_share(missed, prompt)})",
        }
        for name in MISS_CAUSES:
            cells[name] = f"{int(values[name]):,} ({_share(int(values[name]), missed)})"
        rows.append(cells)
    return pd.DataFrame(rows)


def _tokens(run: Run) -> dict[str, int] | None:
    try:
        summary = run.summary
    except FileNotFoundError:
        summary = {}
    if isinstance(summary.get("tokens"), dict):
        return {name: int(summary["tokens"].get(name, 0)) for name in CATEGORIES}
    try:
        table = attribution(run)
    except FileNotFoundError:
        return None
    if table.empty:
        return None
    return {name: int(value) for name, value in token_causes(table).items()}


def _share(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "–"
