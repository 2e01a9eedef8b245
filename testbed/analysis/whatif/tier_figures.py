"""The what-if over tiers drawn: hit rate by tier against L2 capacity, a panel per L1 capacity.

Every line names how it was computed: ``one pass`` (the inclusive LRU hierarchy, exact) or
``simulated`` (any other write or promotion policy, replayed per configuration); Belady's MIN
over the hierarchy's whole capacity is drawn as stars (simulated).
"""

from __future__ import annotations

import textwrap

import pandas as pd
from matplotlib import pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from testbed.analysis.whatif.tiers import ONE_PASS

TIER_STYLES = {"host_hit_rate": ":", "disk_hit_rate": "--", "token_hit_rate": "-"}
TIER_LABELS = {
    "host_hit_rate": "L1 (host)",
    "disk_hit_rate": "L2 (disk)",
    "token_hit_rate": "total",
}


def tier_hit_rate_figure(tiers: pd.DataFrame, title: str = "Hit rate by tier") -> Figure:
    """Hit rate by tier against L2 capacity (tokens), one panel per (chunk size, L1)."""
    figure, panels = _panels(tiers, title)
    for axes, (chunk, l1), chosen in panels:
        for colour, ((write, promote), rows) in zip(
            plt.rcParams["axes.prop_cycle"].by_key()["color"],
            chosen.groupby(["tier_write", "tier_promote"], sort=False),
            strict=False,
        ):
            rows = rows.sort_values("l2_capacity_tokens")
            how = "one pass" if (rows["method"] == ONE_PASS).all() else "simulated"
            for metric, style in TIER_STYLES.items():
                axes.plot(
                    rows["l2_capacity_tokens"], 100 * rows[metric], style, color=colour,
                    marker="o", markersize=3,
                    label=f"{write}+{promote} {TIER_LABELS[metric]} ({how})",
                )  # fmt: skip
        best = chosen.dropna(subset=["belady_hit_tokens"]).drop_duplicates("l2_capacity_tokens")
        if not best.empty:
            axes.plot(
                best["l2_capacity_tokens"],
                100 * best["belady_hit_tokens"] / best["prompt_tokens"].clip(lower=1),
                "*", color="black", label="Belady total (simulated)",
            )  # fmt: skip
        axes.set_xscale("log")
        axes.set_ylim(0, 100)
        axes.set_xlabel("L2 capacity (tokens)")
        axes.set_ylabel("token hit rate (%)")
        axes.set_title(f"chunk {chunk}, L1 {l1:,} tokens", fontsize="small")
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize="xx-small")
    return figure


def tier_ttft_figure(tiers: pd.DataFrame, title: str = "Projected TTFT by tier") -> Figure:
    """Mean projected TTFT against L2 capacity per tier policy, one panel per (chunk, L1); the
    cache-less TTFT dotted. ``tiers`` needs the ``ttft_*`` columns (``--tier-time``)."""
    figure, panels = _panels(tiers, title)
    for axes, (chunk, l1), chosen in panels:
        for (write, promote), rows in chosen.groupby(["tier_write", "tier_promote"], sort=False):
            rows = rows.sort_values("l2_capacity_tokens")
            how = "one pass" if (rows["method"] == ONE_PASS).all() else "simulated"
            axes.plot(rows["l2_capacity_tokens"], rows["ttft_mean_ms"], "-o", markersize=3,
                      label=f"{write}+{promote} ({how})")  # fmt: skip
        axes.axhline(chosen["ttft_no_cache_mean_ms"].iloc[0], linestyle=":", color="grey",
                     label="no cache")  # fmt: skip
        first = chosen.iloc[0]
        axes.set_xscale("log")
        axes.set_ylim(bottom=0)
        axes.set_xlabel("L2 capacity (tokens)")
        axes.set_ylabel(f"mean projected TTFT (ms; {first['time_profile']}, "
                        f"links {first['tier_profile']})")  # fmt: skip
        axes.set_title(f"chunk {chunk}, L1 {l1:,} tokens", fontsize="small")
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize="x-small")
    return figure


def _panels(
    tiers: pd.DataFrame, title: str
) -> tuple[Figure, list[tuple[Axes, tuple[int, int], pd.DataFrame]]]:
    """A titled figure with one panel per (chunk size, L1 capacity) of ``tiers``: each panel's
    axes, its ``(chunk, l1)`` and its rows."""
    keys = sorted({(int(r.chunk_size), int(r.l1_capacity_tokens)) for r in tiers.itertuples()})
    figure, axes_list = plt.subplots(
        1, len(keys), figsize=(6 * len(keys), 5), squeeze=False, layout="constrained"
    )
    figure.suptitle(textwrap.fill(title, 100))
    panels = []
    for axes, (chunk, l1) in zip(axes_list[0], keys, strict=True):
        chosen = tiers[(tiers["chunk_size"] == chunk) & (tiers["l1_capacity_tokens"] == l1)]
        panels.append((axes, (chunk, l1), chosen))
    return figure, panels
