"""Figures from the analysis tables (matplotlib; every axis labelled with its unit).

Each function takes DataFrames and returns a ``Figure``; :mod:`testbed.report.sweep_report`
saves them as PNG, notebooks show them inline. Oracle runs are drawn dashed: they are bounds,
not measurements. Token categories take :mod:`testbed.analysis.palette`'s colours.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
from matplotlib import pyplot as plt
from matplotlib.figure import Figure

from testbed.analysis.palette import CATEGORY_LABELS, RECOMPUTED, colour

AXIS_LABELS = {
    "chunk_size": "chunk size (tokens)",
    "capacity_tokens": "cache capacity (tokens)",
    "capacity_bytes": "cache capacity (bytes)",
    "tp": "tensor-parallel size",
    "mla": "MLA",
    "policy": "eviction policy",
    "workload": "workload",
    "engine_blocks": "vLLM KV pool (blocks)",
    "requests": "requests",
    "block_size": "block size (tokens)",
    "profile": "KV profile",
    "seed": "seed",
}


def axis_label(key: str) -> str:
    return AXIS_LABELS.get(key, key.replace("_", " "))


def _new(title: str, size: tuple[float, float] = (8, 5)) -> tuple[Figure, plt.Axes]:
    figure, axes = plt.subplots(figsize=(max(8.0, size[0]), size[1]), layout="constrained")
    axes.set_title(textwrap.fill(title, 80))
    axes.grid(True, alpha=0.3)
    return figure, axes


def _positions(values: Sequence[object]) -> tuple[list[float], list[str] | None]:
    """Numeric x positions, and tick labels when the values are categories."""
    if all(
        isinstance(v, int | float | np.integer | np.floating) and not isinstance(v, bool)
        for v in values
    ):
        return [float(v) for v in values], None  # type: ignore[arg-type]
    categories = list(dict.fromkeys(str(v) for v in values))
    return [float(categories.index(str(v))) for v in values], categories


def short_label(value: object) -> str:
    """A value as a tick label: trace paths shortened to ``prefix:file-stem``."""
    text = str(value)
    prefix, colon, path = text.partition(":")
    if colon and "/" in path:
        return f"{prefix}:{path.rsplit('/', 1)[-1].split('.')[0]}"
    return text


def hit_rate(
    index: pd.DataFrame,
    x: str,
    series: Sequence[str] = (),
    *,
    metric: str = "token_hit_rate",
    title: str = "Token hit rate",
) -> Figure:
    """``metric`` (a rate) against ``x``, one line (numeric ``x``) or bar group (categories)
    per engine and series value; oracle runs dashed or hatched."""
    figure, axes = _new(title)
    _, categories = _positions(index[x].tolist())
    groups = list(index.groupby(["engine", *series], sort=True, dropna=False))
    width = 0.8 / max(1, len(groups))
    for number, (labels, group) in enumerate(groups):
        labels = labels if isinstance(labels, tuple) else (labels,)
        engine = labels[0]
        name = ", ".join(
            [
                str(engine),
                *(f"{k}={short_label(v)}" for k, v in zip(series, labels[1:], strict=True)),
            ]
        )
        oracle = engine == "oracle"
        if categories:
            xs = [
                categories.index(str(v)) + (number - (len(groups) - 1) / 2) * width
                for v in group[x]
            ]
            axes.bar(xs, group[metric] * 100, width, label=name, hatch="//" if oracle else None,
                     alpha=0.6 if oracle else 1.0)  # fmt: skip
        else:
            group = group.sort_values(x)
            axes.plot(group[x].astype(float), group[metric] * 100, marker="o",
                      linestyle="--" if oracle else "-", label=name)  # fmt: skip
    if categories:
        axes.set_xticks(range(len(categories)), [short_label(c) for c in categories])
    else:
        values = sorted(index[x].dropna().astype(float).unique())
        if x in ("chunk_size", "capacity_tokens", "capacity_bytes") and len(values) > 2:
            axes.set_xscale("log", base=2)
        axes.set_xticks(values, [f"{v:g}" for v in values])
        axes.minorticks_off()
    axes.set_xlabel(axis_label(x))
    axes.set_ylabel(f"{metric.replace('_', ' ')} (%)")
    axes.set_ylim(0, 100)
    axes.legend(fontsize="small")
    return figure


def token_breakdown(table: pd.DataFrame, label: str, title: str) -> Figure:
    """Stacked bars per row of ``table``: the share of prompt tokens from the engine's prefix
    cache, from the external cache, and recomputed (columns ``engine_hit_tokens``,
    ``external_hit_tokens``, ``recomputed_tokens``). Shares, so that runs of different sizes
    compare."""
    figure, axes = _new(title, (max(6, 0.9 * len(table) + 3), 5))
    positions = np.arange(len(table))
    columns = {
        "engine_hit_tokens": ("engine", CATEGORY_LABELS["engine"]),
        "external_hit_tokens": ("external", CATEGORY_LABELS["external"]),
        "recomputed_tokens": (RECOMPUTED, "recomputed (every cause of a miss)"),
    }
    totals = table[list(columns)].astype(float).sum(axis=1).to_numpy()
    bottom = np.zeros(len(table))
    for column, (key, name) in columns.items():
        values = 100 * table[column].astype(float).to_numpy() / np.maximum(totals, 1)
        axes.bar(positions, values, bottom=bottom, label=name, color=colour(key))
        bottom += values
    axes.set_xticks(positions, table[label].astype(str), rotation=30, ha="right")
    axes.set_ylabel("share of prompt tokens (%)")
    axes.set_ylim(0, 115)
    axes.legend(fontsize="small", loc="upper right", ncols=3)
    return figure


def latency_cdf(durations: Mapping[str, Mapping[str, Sequence[float]]], title: str) -> Figure:
    """CDFs of operation latency: ``durations[operation][run label]`` in ms, one panel per op
    (the whole spread; each run's number of operations in the legend)."""
    operations = list(durations)
    figure, panels = plt.subplots(
        1, len(operations), figsize=(5 * len(operations), 4.5), layout="constrained", squeeze=False
    )
    figure.suptitle(textwrap.fill(title, 120))
    for axes, operation in zip(panels[0], operations, strict=True):
        for label, values in durations[operation].items():
            if len(values) == 0:
                continue
            ordered = np.sort(np.asarray(values, dtype=float))
            axes.plot(
                ordered,
                np.arange(1, len(ordered) + 1) / len(ordered),
                label=f"{label} (n={len(ordered)})",
            )
        axes.set_xscale("log")
        axes.set_title(operation)
        axes.set_xlabel("latency (ms of wall clock, log scale)")
        axes.set_ylabel("fraction of operations")
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize="x-small")
    return figure


def grouped_bars(
    table: pd.DataFrame,
    label: str,
    columns: Mapping[str, str],
    ylabel: str,
    title: str,
    scale: float = 1.0,
) -> Figure:
    """Bars of several ``columns`` (column → legend name) per row label."""
    figure, axes = _new(title, (max(6, 0.9 * len(table) + 3), 5))
    positions = np.arange(len(table))
    width = 0.8 / max(1, len(columns))
    for offset, (column, name) in enumerate(columns.items()):
        axes.bar(
            positions + offset * width,
            table[column].fillna(0).astype(float) / scale,
            width,
            label=name,
        )
    axes.set_xticks(
        positions + width * (len(columns) - 1) / 2,
        table[label].astype(str),
        rotation=30,
        ha="right",
    )
    axes.set_ylabel(ylabel)
    axes.legend(fontsize="small")
    return figure


def distributions(values: Mapping[str, Sequence[float]], ylabel: str, title: str) -> Figure:
    """Box plots of one quantity per label (log scale), e.g. lock hold times per run."""
    labels = [label for label, v in values.items() if len(v)]
    figure, axes = _new(title, (max(6, 0.9 * len(labels) + 3), 5))
    if labels:
        axes.boxplot([np.asarray(values[label], dtype=float) for label in labels], showfliers=False)
        axes.set_xticks(range(1, len(labels) + 1), labels, rotation=30, ha="right")
        axes.set_yscale("log")
    else:
        axes.text(0.5, 0.5, "no data", ha="center", va="center", transform=axes.transAxes)
    axes.set_ylabel(ylabel)
    return figure


def close(figure: Figure) -> None:
    plt.close(figure)


def timeline(spans: pd.DataFrame, trace_id: str, title: str) -> Figure:
    """One trace as a Gantt chart: a bar per span from start to end, nested by depth."""
    trace = spans[spans["trace_id"] == trace_id].sort_values("start_time")
    depth: dict[str, int] = {}
    for row in trace.itertuples():
        depth[row.span_id] = depth.get(row.parent_span_id, -1) + 1 if row.parent_span_id else 0
    origin = trace["start_time"].min()
    figure, axes = _new(title, (10, 0.35 * len(trace) + 2))
    for position, row in enumerate(trace.itertuples()):
        start_ms = (row.start_time - origin).total_seconds() * 1e3
        side = (
            "server"
            if ".server." in row.name
            else "connector"
            if ".connector." in row.name
            else "engine"
        )
        color = {"server": "tab:orange", "connector": "tab:blue", "engine": "tab:gray"}[side]
        axes.barh(position, max(row.duration_ms, 0.01), left=start_ms, color=color)
        axes.text(
            start_ms,
            position,
            "  " * depth[row.span_id] + row.name,
            va="center",
            fontsize="x-small",
        )
    axes.invert_yaxis()
    axes.set_yticks([])
    axes.set_xlabel("time since the request's first span (ms)")
    return figure


def histogram(values: Sequence[float], xlabel: str, title: str, bins: int = 20) -> Figure:
    figure, axes = _new(title)
    axes.hist(np.asarray(values, dtype=float), bins=bins)
    axes.set_xlabel(xlabel)
    axes.set_ylabel("requests")
    return figure
