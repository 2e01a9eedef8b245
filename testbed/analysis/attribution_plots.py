"""Where every prompt token went, per run: the stacked figure and the table of miss causes.

The figure stacks the categories of :mod:`testbed.analysis.attribution` (shares of the
prompt tokens); the table is the 3C table of cache studies, for KV reuse: ``cold`` is the
compulsory miss, ``capacity`` the capacity miss, there are no conflict misses (the cache is
fully associative), and the other causes are particular to a KV cache behind an engine. The
colours are :mod:`testbed.analysis.palette`'s, as in every other figure.
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
from testbed.analysis.palette import CATEGORY_COLOURS, CATEGORY_LABELS
from testbed.analysis.tables import Run


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
    for index, name in enumerate(CATEGORIES):  # all of them in the legend, also those that are 0
        axes.bar(
            positions,
            shares[:, index],
            bottom=bottom,
            color=CATEGORY_COLOURS[name],
            label=CATEGORY_LABELS[name],
        )
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
