"""What-if figures: hit rate against capacity, the minimum-capacity gauge, reuse CDFs.

Each function takes a :class:`~.results.WhatIf` (computed or loaded) and returns a matplotlib
``Figure``. :func:`whatif_figures` lists them as ``(file name, figure, caption)`` for
``kvtb whatif --figures``; :func:`sweep_figures` is the hook ``kvtb report`` calls for a sweep
that varies capacity or policy (the sweep's workload curve with its measured runs on it).
"""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib import pyplot as plt
from matplotlib.figure import Figure

from testbed.analysis.whatif.results import WhatIf
from testbed.sizes import format_bytes

log = logging.getLogger(__name__)

FigureEntry = tuple[str, Figure, str]
POLICY_MARKERS = {"belady": "*", "fifo": "s", "lfu": "^", "lru": "o"}
_CURVE_SAMPLES = 400  # points drawn per LRU curve (the exact curve can have millions of steps)
_MAX_GROUP_LINES = 6


def hit_rate_figure(
    whatif: WhatIf,
    measured: pd.DataFrame | None = None,
    *,
    metric: str = "token_hit_rate",
    title: str = "Hit rate against cache capacity",
) -> Figure:
    """Per chunk size: the exact LRU curve (solid), the simulated policies' points (markers),
    the unlimited cache (dotted); ``measured`` runs (``capacity_tokens``, ``metric``,
    ``label``, optional ``chunk_size``) as black-edged points."""
    figure, axes = _new(title)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for number, size in enumerate(sorted(whatif.points["chunk_size"].unique())):
        colour = colours[number % len(colours)]
        xs, ys = _curve_samples(whatif, int(size), metric)
        axes.step(xs, ys * 100, where="post", color=colour, label=f"LRU, chunk {size}")
        points = whatif.points[whatif.points["chunk_size"] == size]
        unlimited = points[points["capacity_tokens"].isna()][metric]
        if len(unlimited):
            axes.axhline(float(unlimited.iloc[0]) * 100, color=colour, linestyle=":", lw=1)
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
    if measured is not None and len(measured):
        shown = measured[measured["capacity_tokens"].notna()]
        for label, group in shown.groupby("label"):
            axes.plot(
                group["capacity_tokens"].astype(float),
                group[metric] * 100,
                linestyle="none",
                marker="D",
                markerfacecolor="none",
                markeredgecolor="black",
                label=f"measured: {label}",
            )
    axes.set_xscale("log")
    axes.set_xlabel("cache capacity (tokens of KV, log scale)")
    axes.set_ylabel(f"{metric.replace('_', ' ')} (%)")
    axes.set_ylim(0, 100)
    axes.legend(fontsize="x-small", ncols=2)
    return figure


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
    axes.set_xlabel("share of the unlimited cache's hits kept")
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
    for axes, column, label in (
        (panels[0], "reuse_distance_bytes", "reuse distance (bytes, log scale)"),
        (panels[1], "reuse_interval_s", "reuse interval (s, log scale)"),
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
    ]


def sweep_figures(
    sweep_dir: Path, runs: pd.DataFrame, swept: list[str], context: str
) -> list[FigureEntry]:
    """``kvtb report``'s what-if figures: when the sweep varies capacity or policy, the
    curves of the sweep's workload with every measured run as a point. ``[]`` otherwise, or
    when the runs do not share one workload."""
    if not {"capacity_tokens", "capacity_bytes", "policy"} & set(swept):
        return []
    from testbed.analysis.whatif.analyze import WhatIfOptions, what_if_workload
    from testbed.analysis.whatif.runlog import run_spec

    try:
        specs = [run_spec(Path(sweep_dir) / run_id) for run_id in runs["run_id"]]
        identity = {(s.workload, s.requests, s.seed, str(s.workload_params)) for s in specs}
        if len(identity) != 1:
            log.info("no what-if figures for %s: its runs differ in workload", sweep_dir)
            return []
        measured = _measured_points(runs, specs)
        policies = sorted({"belady", *(s.policy for s in specs)} & {"belady", "fifo", "lfu"})
        options = WhatIfOptions(
            chunk_sizes=tuple(sorted({s.chunk_size for s in specs})),
            policies=("lru", *policies),
            at_tokens=tuple(sorted({int(c) for c in measured["capacity_tokens"].dropna()})),
            policy_points=1,
        )
        whatif = what_if_workload(specs[0], options)
    except (ValueError, FileNotFoundError) as exc:
        # An optional figure: the rest of the report does not depend on it.
        log.warning("no what-if figures for %s: %s", sweep_dir, exc)
        return []
    return whatif_figures(whatif, measured, context)


def _measured_points(runs: pd.DataFrame, specs: list) -> pd.DataFrame:
    rows = []
    for (_, run), spec in zip(runs.iterrows(), specs, strict=True):
        capacity = spec.capacity()
        per_token = spec.kv_profile.stored_bytes_per_token(spec.tp)
        rows.append(
            {
                "label": f"{run['engine']} {spec.policy}",
                "chunk_size": spec.chunk_size,
                "capacity_tokens": None if capacity is None else capacity // per_token,
                "token_hit_rate": run.get("token_hit_rate"),
                "mean_request_hit_rate": run.get("mean_request_hit_rate"),
            }
        )
    return pd.DataFrame(rows)


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
