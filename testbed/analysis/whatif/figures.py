"""What-if figures: hit rate against capacity, the minimum-capacity gauge, reuse CDFs.

Each function takes a :class:`~.results.WhatIf` (computed or loaded) and returns a matplotlib
``Figure``. :func:`whatif_figures` lists them as ``(file name, figure, caption)`` for
``kvtb whatif --figures``; :func:`curve_panels_figure` draws runs against curves of the
quantity they measure, a panel per comparison (:mod:`testbed.analysis.capacity_whatif`, which
``kvtb report`` and the notebooks call). Hit-rate axes run from 0 to 100 %; time axes name
their clock.
"""

from __future__ import annotations

import logging
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib import pyplot as plt
from matplotlib.figure import Figure

from testbed.analysis.palette import CATEGORY_COLOURS
from testbed.analysis.whatif.results import WhatIf
from testbed.core.sizes import format_bytes

log = logging.getLogger(__name__)

FigureEntry = tuple[str, Figure, str]
POLICY_MARKERS = {"belady": "*", "fifo": "s", "lfu": "^", "lru": "o"}
RUN_MARKERS = ("D", "o", "s", "^", "v", "P", "X", "h", "<", ">")
RUN_COLOURS = ("white", "gold", "tab:pink", "lightskyblue", "tab:brown", "plum", "khaki", "coral")
"""Runs as points: each its own marker and face colour, cycling independently."""
_CURVE_SAMPLES = 400  # points drawn per LRU curve (the exact curve can have millions of steps)
_MAX_GROUP_LINES = 6


@dataclass(frozen=True, eq=False)
class CurvePanel:
    """Runs against a curve of the quantity they measure (one panel of a figure)."""

    title: str
    whatif: WhatIf
    points: pd.DataFrame
    """``label``, ``capacity_tokens``, ``token_hit_rate`` (optional ``chunk_size``)."""
    quantity: str
    """The y-axis: which hits the curve and the points count."""
    floor: float | None = None
    """A share the curve starts from, drawn dashed (vLLM's own hits, ``E / P``)."""

    def retitled(self, title: str) -> CurvePanel:
        return CurvePanel(title, self.whatif, self.points, self.quantity, self.floor)


def hit_rate_figure(
    whatif: WhatIf,
    measured: pd.DataFrame | None = None,
    *,
    metric: str = "token_hit_rate",
    title: str = "Hit rate against cache capacity",
) -> Figure:
    """Per chunk size: the exact LRU curve (solid), the simulated policies' points (markers),
    the unlimited cache (dotted); ``measured`` runs (``capacity_tokens``, ``metric``,
    ``label``) as points, each its own marker and colour."""
    figure, axes = _new(title)
    _draw_curves(axes, whatif, metric)
    if measured is not None:
        _draw_points(axes, measured, metric)
    _capacity_axes(axes, f"{metric.replace('_', ' ')} (%)")
    return figure


def curve_panels_figure(rows: Sequence[tuple[str, Sequence[CurvePanel]]], title: str) -> Figure:
    """One row per workload, one panel per comparison: each panel's runs against the curve of
    the same quantity, the y-axis naming it (0 to 100 %)."""
    columns = max(len(panels) for _, panels in rows)
    figure, grid = plt.subplots(
        len(rows), columns, figsize=(7.5 * columns, 5.2 * len(rows)),
        layout="constrained", squeeze=False,
    )  # fmt: skip
    figure.suptitle(textwrap.fill(title, 60 * columns))
    for axes_row, (_, panels) in zip(grid, rows, strict=True):
        for axes, panel in zip(axes_row, panels, strict=False):
            axes.set_title(textwrap.fill(panel.title, 70), fontsize="medium")
            axes.grid(True, alpha=0.3)
            _draw_curves(axes, panel.whatif, "token_hit_rate")
            if panel.floor is not None:
                label = f"vLLM's prefix cache alone: {panel.floor:.1%}"
                axes.axhline(panel.floor * 100, color=CATEGORY_COLOURS["engine"], linestyle="--",
                             lw=1.2, label=label)  # fmt: skip
            _draw_points(axes, panel.points, "token_hit_rate")
            _capacity_axes(axes, panel.quantity)
        for axes in list(axes_row)[len(panels) :]:
            axes.axis("off")
    return figure


def not_applicable(title: str, reason: str) -> Figure:
    """A figure that says why there is nothing to draw."""
    figure, axes = plt.subplots(figsize=(9, 2.5), layout="constrained")
    axes.set_title(textwrap.fill(title, 90))
    axes.axis("off")
    axes.text(0.5, 0.5, textwrap.fill(f"No what-if for this source: {reason}", 90),
              ha="center", va="center", transform=axes.transAxes)  # fmt: skip
    return figure


def short_workload(workload: str) -> str:
    """A workload as a label: a trace by its kind and file stem (``mooncake:conversation``)."""
    kind, colon, path = workload.partition(":")
    return f"{kind}:{Path(path).stem}" if colon and path else workload


def _draw_curves(axes: plt.Axes, whatif: WhatIf, metric: str) -> None:
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for number, size in enumerate(sorted(whatif.points["chunk_size"].unique())):
        colour = colours[number % len(colours)]
        xs, ys = _curve_samples(whatif, int(size), metric)
        axes.step(xs, ys * 100, where="post", color=colour, label=f"LRU, chunk {size}")
        points = whatif.points[whatif.points["chunk_size"] == size]
        unlimited = points[points["capacity_tokens"].isna()][metric]
        if len(unlimited):
            rate = float(unlimited.iloc[0])
            axes.axhline(rate * 100, color=colour, linestyle=":", lw=1,
                         label=f"unlimited, chunk {size}: {rate:.1%}")  # fmt: skip
        for policy, group in points[points["capacity_tokens"].notna()].groupby("policy"):
            if policy == "lru":
                continue
            axes.plot(
                group["capacity_tokens"].astype(float),
                group[metric] * 100,
                linestyle="none",
                marker=POLICY_MARKERS.get(str(policy), "x"),
                color=colour,
                markersize=9 if policy == "belady" else 6,
                label=f"{policy}, chunk {size}",
            )


def _draw_points(axes: plt.Axes, points: pd.DataFrame, metric: str) -> None:
    """Each run its own marker and colour (distinct from the curves' solid colours), black
    edged, so that no two runs look alike even where they overlap."""
    shown = points[points["capacity_tokens"].notna()]
    for number, (label, group) in enumerate(shown.groupby("label", sort=False)):
        axes.plot(
            group["capacity_tokens"].astype(float),
            group[metric] * 100,
            linestyle="none",
            marker=RUN_MARKERS[number % len(RUN_MARKERS)],
            markersize=9,
            markerfacecolor=RUN_COLOURS[number % len(RUN_COLOURS)],
            markeredgecolor="black",
            alpha=0.85,
            label=f"run: {label}",
        )


def _capacity_axes(axes: plt.Axes, ylabel: str) -> None:
    axes.set_xscale("log")
    axes.set_xlabel("external cache capacity (tokens of KV, log scale)")
    axes.set_ylabel(ylabel)
    axes.set_ylim(0, 100)
    axes.legend(fontsize="x-small", ncols=2, loc="upper left")  # curves rise to the right


def min_capacity_figure(whatif: WhatIf, title: str = "Minimum LRU capacity") -> Figure:
    """Bars: the smallest LRU capacity keeping each share of the unlimited cache's hits, per
    chunk size (tokens, log scale; bytes written on the bars)."""
    figure, axes = _new(title)
    table = whatif.min_capacity
    fractions = sorted(table["fraction"].unique())
    sizes = sorted(table["chunk_size"].unique())
    width = 0.8 / max(1, len(sizes))
    for offset, size in enumerate(sizes):
        rows = table[table["chunk_size"] == size].set_index("fraction").reindex(fractions)
        xs = np.arange(len(fractions)) + (offset - (len(sizes) - 1) / 2) * width
        tokens = rows["capacity_tokens"].astype(float).to_numpy()
        axes.bar(xs, np.maximum(tokens, 1), width, label=f"chunk {size}")
        for x, value, nbytes in zip(xs, tokens, rows["capacity_bytes"], strict=True):
            axes.text(x, max(value, 1), format_bytes(float(nbytes)), ha="center", va="bottom",
                      fontsize="xx-small", rotation=90)  # fmt: skip
    axes.set_xticks(range(len(fractions)), [f"{f:.0%}" for f in fractions])
    axes.set_yscale("log")
    axes.set_xlabel(
        "share of the unlimited cache's external hits kept"
        if _is_run(whatif)
        else "share of the unlimited cache's hits kept"
    )
    axes.set_ylabel("minimum capacity (tokens, log scale)")
    axes.legend(fontsize="small")
    return figure


def reuse_cdf_figure(whatif: WhatIf, title: str = "Reuse distance and interval") -> Figure:
    """CDFs of reuse distance (bytes) and reuse interval (s): ``all`` per chunk size, and the
    busiest groups of the smallest chunk size (thin)."""
    figure, panels = plt.subplots(1, 2, figsize=(11, 4.5), layout="constrained")
    figure.suptitle(textwrap.fill(title, 110))
    reuse = whatif.reuse
    sizes = sorted(reuse["chunk_size"].unique())
    clock = "the cache server's clock" if _is_run(whatif) else "the workload's arrival clock"
    for axes, column, label in (
        (panels[0], "reuse_distance_bytes", "reuse distance (bytes, log scale)"),
        (panels[1], "reuse_interval_s", f"reuse interval (s of {clock}, log scale)"),
    ):
        for size in sizes:
            rows = reuse[(reuse["chunk_size"] == size) & (reuse["group"] == "all")]
            axes.plot(rows[column], rows["quantile"], label=f"all, chunk {size}")
        groups = (
            reuse[(reuse["chunk_size"] == sizes[0]) & (reuse["group"] != "all")] if sizes else reuse
        )
        busiest = groups.drop_duplicates("group").nlargest(_MAX_GROUP_LINES, "count")["group"]
        for group in busiest:
            rows = groups[groups["group"] == group]
            axes.plot(rows[column], rows["quantile"], lw=0.8, alpha=0.6, label=str(group))
        axes.set_xscale("log")
        axes.set_xlabel(label)
        axes.set_ylabel("fraction of reused chunks")
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize="x-small")
    return figure


def whatif_figures(
    whatif: WhatIf, measured: pd.DataFrame | None = None, context: str = ""
) -> list[FigureEntry]:
    """Every what-if figure as ``(file name, figure, caption)``."""
    suffix = f" — {context}" if context else ""
    source = "a run's recorded accesses" if _is_run(whatif) else "the workload (oracle keys)"
    return [
        (
            "whatif_hit_rate.png",
            hit_rate_figure(whatif, measured, title=f"Hit rate against capacity{suffix}"),
            f"Token hit rate at every LRU capacity from one pass over {source} (solid steps), "
            "other policies simulated at sampled capacities (markers), the unlimited cache "
            "(dotted)" + (" and the measured runs (diamonds)." if measured is not None else "."),
        ),
        (
            "whatif_min_capacity.png",
            min_capacity_figure(whatif, title=f"Minimum LRU capacity{suffix}"),
            "The smallest LRU capacity that keeps 60-99% of the unlimited cache's hits "
            "(tokens; bytes on the bars).",
        ),
        (
            "whatif_reuse.png",
            reuse_cdf_figure(whatif, title=f"Reuse distance and interval{suffix}"),
            "CDFs over reused chunks: stack distance in bytes (the LRU capacity that would still "
            "hold the chunk) and time since its last use.",
        ),
        *_tier_figures(whatif, suffix),
    ]


def _tier_figures(whatif: WhatIf, suffix: str) -> list[FigureEntry]:
    if whatif.tiers is None or whatif.tiers.empty:
        return []
    from testbed.analysis.whatif.tier_figures import tier_hit_rate_figure, tier_ttft_figure

    entries = [
        (
            "whatif_tiers.png",
            tier_hit_rate_figure(
                whatif.tiers, title=f"Hit rate by tier against L2 capacity{suffix}"
            ),
            "Token hit rate served by L1 (host, dotted), L2 (disk, dashed) and both (solid) at "
            "every L2 capacity, a panel per L1 capacity: the inclusive LRU hierarchy from one "
            "pass, other write and promotion policies simulated (as labelled); Belady's MIN "
            "over the whole hierarchy as stars.",
        )
    ]
    if "ttft_mean_ms" in whatif.tiers:
        entries.append(
            (
                "whatif_tiers_ttft.png",
                tier_ttft_figure(whatif.tiers, title=f"Projected TTFT by tier{suffix}"),
                "Mean projected TTFT with the hits each tier served (a disk hit costs its read "
                "into L1 on top of the host copy; links of the named tier profile) against L2 "
                "capacity; the cache-less TTFT dotted.",
            )
        )
    return entries


def _curve_samples(whatif: WhatIf, chunk_size: int, metric: str) -> tuple[np.ndarray, np.ndarray]:
    """The exact LRU curve thinned to log-spaced capacities (value: the last step before)."""
    curve = whatif.curves[whatif.curves["chunk_size"] == chunk_size]
    capacities = curve["capacity_tokens"].to_numpy(dtype=np.float64)
    values = curve[metric].to_numpy(dtype=np.float64)
    top = max(float(capacities.max()) if len(capacities) else chunk_size, chunk_size) * 1.2
    xs = np.geomspace(chunk_size, top, _CURVE_SAMPLES)
    index = np.searchsorted(capacities, xs, side="right") - 1
    ys = np.where(index >= 0, values[np.maximum(index, 0)], 0.0)
    return xs, ys


def _new(title: str) -> tuple[Figure, plt.Axes]:
    figure, axes = plt.subplots(figsize=(9, 5.5), layout="constrained")
    axes.set_title(textwrap.fill(title, 90))
    axes.grid(True, alpha=0.3)
    return figure, axes


def _is_run(whatif: WhatIf) -> bool:
    source = whatif.meta.get("source") or {}
    return source.get("kind") == "run"
