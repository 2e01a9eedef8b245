"""Where a cache operation's time goes: waiting, the server, the copy, and the rest.

A connector-side ``kvcache.connector.lookup``, ``.store`` or ``.retrieve`` span lasts from the
operation's start to the moment its result is used. The connector records three parts of it
as span attributes (each only where it applies and was measured):

- **waiting** (``kvcache.poll_wait_ms``): from the answer being ready to its use, by the
  scheduler's next poll (lookup) or vLLM's next ``get_finished`` (store, retrieve);
- **server** (``kvcache.server_ms``): from sending the request(s) to the reply(ies): the
  network and the server's work;
- **copy** (``kvcache.copy_ms``): copying KV between vLLM's blocks and the pool.

**other** is the rest of the span: planning, serialisation, queueing before the send. When
the server makes the copy (server-driven transfers, ``kvcache.server_copied``) the copy is
inside **server**, and the worker's own **copy** is (close to) zero. A span with none of the
parts is not split: it shows its total only, as ``total``. Parts are as the connector
reports them; should they exceed the span, ``other`` is clipped at zero and ``overlap_ms``
says by how much.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd
from matplotlib import pyplot as plt
from matplotlib.figure import Figure

from testbed.analysis.tables import Run
from testbed.core.telemetry import attributes as a

PARTS = {"waiting": a.POLL_WAIT_MS, "server": a.SERVER_MS, "copy": a.COPY_MS}
"""Part name → span attribute, in stacking order."""
OPERATIONS = {
    "lookup": a.CONNECTOR_LOOKUP,
    "store": a.CONNECTOR_STORE,
    "retrieve": a.CONNECTOR_RETRIEVE,
}
OTHER, TOTAL = "other", "total"
SPREAD = (0.1, 0.5, 0.9)
"""Quantiles of an operation's duration the table carries (its spread)."""
COLUMNS = [
    "operation", "part", "count", "mean_ms", "share", "operations", "p10_ms", "p50_ms", "p90_ms",
]  # fmt: skip
COLOURS = {
    "waiting": "tab:orange",
    "server": "tab:blue",
    "copy": "tab:green",
    OTHER: "tab:gray",
    TOTAL: "0.8",
}


def operation_parts(spans: pd.DataFrame) -> pd.DataFrame:
    """One row per connector lookup, store and retrieve span: ``run_id``, ``operation``,
    ``trace_id``, ``span_id``, ``start_time``, ``duration_ms``, ``<part>_ms`` for every part of
    :data:`PARTS` (NaN where the span does not carry it), ``other_ms`` (duration minus the
    parts it carries, at least 0), ``overlap_ms`` and ``split`` (whether it carries any)."""
    names = {name: operation for operation, name in OPERATIONS.items()}
    ops = spans[spans["name"].isin(list(names))]
    frame = pd.DataFrame(
        {
            "run_id": ops["run_id"].astype(str).to_numpy(),
            "operation": ops["name"].map(names).to_numpy(),
            "trace_id": ops["trace_id"].to_numpy(),
            "span_id": ops["span_id"].to_numpy(),
            "start_time": ops["start_time"].to_numpy(),
            "duration_ms": ops["duration_ms"].astype(float).to_numpy(),
        }
    )
    known = np.zeros(len(frame))
    split = np.zeros(len(frame), dtype=bool)
    for part, attribute in PARTS.items():
        values = (
            pd.to_numeric(ops[attribute], errors="coerce").astype(float).to_numpy()
            if attribute in ops
            else np.full(len(frame), np.nan)
        )
        frame[f"{part}_ms"] = values
        known += np.nan_to_num(values)
        split |= ~np.isnan(values)
    rest = frame["duration_ms"].to_numpy() - known
    frame["other_ms"] = np.maximum(rest, 0.0)
    frame["overlap_ms"] = np.maximum(-rest, 0.0)
    frame["split"] = split
    return frame


def latency_split(spans: pd.DataFrame) -> pd.DataFrame:
    """The mean time of each operation, by part: one row per (``operation``, ``part``) with
    ``count`` (spans that carry it), ``mean_ms`` (its contribution to the operation's mean
    duration) and ``share`` (of that mean), and the operation's ``operations`` (spans) and
    the spread of their durations, ``p10_ms``, ``p50_ms``, ``p90_ms``. The parts come from
    the spans that carry any (``other`` is their rest); spans that carry none add one row
    ``total``. A part no span of the operation carries has no row (nothing is made up), and
    the rows of an operation sum to its mean duration (up to ``overlap_ms``)."""
    parts = operation_parts(spans)
    rows = []
    for operation in OPERATIONS:
        ops = parts[parts["operation"] == operation]
        if ops.empty:
            continue
        split, unsplit = ops[ops["split"]], ops[~ops["split"]]
        entries = []
        for part in PARTS:
            values = split[f"{part}_ms"]
            if values.notna().any():
                entries.append((part, int(values.notna().sum()), values.fillna(0).sum()))
        if len(split):
            entries.append((OTHER, len(split), split["other_ms"].sum()))
        if len(unsplit):
            entries.append((TOTAL, len(unsplit), unsplit["duration_ms"].sum()))
        mean_duration = float(ops["duration_ms"].mean())
        spread = np.quantile(ops["duration_ms"].to_numpy(), SPREAD).tolist()
        for part, count, total_ms in entries:
            mean_ms = float(total_ms) / len(ops)  # summed over the op's spans, per span
            share = mean_ms / mean_duration if mean_duration > 0 else 0.0
            rows.append((operation, part, count, mean_ms, share, len(ops), *spread))
    return pd.DataFrame(rows, columns=COLUMNS)


def run_latency_split(run: Run) -> pd.DataFrame:
    """:func:`latency_split` of one run's spans."""
    return latency_split(run.spans)


def split_table(splits: Mapping[str, pd.DataFrame]) -> pd.DataFrame:
    """The :func:`latency_split` tables of several runs, one under the other, with ``run``."""
    frames = [table.assign(run=label) for label, table in splits.items()]
    columns = ["run", *COLUMNS]
    if not frames:
        return pd.DataFrame(columns=columns)
    return pd.concat(frames, ignore_index=True)[columns]


def latency_split_figure(splits: Mapping[str, pd.DataFrame], title: str) -> Figure:
    """Stacked horizontal bars, one per operation and run (``splits``: label →
    :func:`latency_split`): the mean time by part; an operation whose spans carry no part
    is one light bar, its total. Over each bar its spread (the median and p10 to p90 of the
    durations) and its number of operations."""
    bars = [
        (operation, label, table[table["operation"] == operation])
        for operation in OPERATIONS
        for label, table in splits.items()
        if (table["operation"] == operation).any()
    ]
    height = max(3.0, 0.45 * len(bars) + 2)
    figure, axes = plt.subplots(figsize=(10, height), layout="constrained")
    axes.set_title(textwrap.fill(title, 90))
    axes.grid(True, axis="x", alpha=0.3)
    handles: dict[str, Any] = {}
    for position, (_, _, rows) in enumerate(bars):
        left = 0.0
        for part in (*PARTS, OTHER, TOTAL):
            row = rows[rows["part"] == part]
            if row.empty:
                continue
            width = float(row["mean_ms"].iloc[0])
            handles[part] = axes.barh(position, width, left=left, color=COLOURS[part])
            left += width
    if not bars:
        axes.text(
            0.5,
            0.5,
            "no lookup, store or retrieve spans",
            ha="center",
            va="center",
            transform=axes.transAxes,
        )
    for position, (_, _, rows) in enumerate(bars):
        low, median, high = (float(rows[c].iloc[0]) for c in ("p10_ms", "p50_ms", "p90_ms"))
        axes.errorbar(median, position, xerr=[[median - low], [high - median]], fmt="o",
                      color="black", markersize=3, capsize=3, lw=1)  # fmt: skip
        count = f"n={int(rows['operations'].iloc[0])}"
        axes.annotate(count, (high, position), xytext=(4, 0), textcoords="offset points",
                      va="center", fontsize="x-small")  # fmt: skip
    axes.set_yticks(range(len(bars)), [f"{op} — {label}" for op, label, _ in bars])
    axes.invert_yaxis()
    axes.set_xlabel(
        "mean time per operation (ms of wall clock), by part; black: median and p10-p90"
    )
    axes.set_xlim(left=0)
    order = [part for part in (*PARTS, OTHER, TOTAL) if part in handles]  # stacking order
    if order:
        names = ["total (the spans carry no parts)" if p == TOTAL else p for p in order]
        axes.legend(
            [handles[p] for p in order],
            names,
            fontsize="small",
            loc="upper left",
            bbox_to_anchor=(1.0, 1.0),
        )
    return figure
