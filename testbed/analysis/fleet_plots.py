"""Fleet figures: routers against load, and one fleet's instances side by side.

- :func:`routers_figure`: token hit rate and routing loss (shares of the prompt tokens)
  against the offered load per instance, one line per router (and per combination of the other
  keys given), from a :func:`testbed.analysis.fleet.router_table`;
- :func:`instance_figure`: each instance's prompt tokens by source (its prefix cache, the
  cache server, computed) and its queueing and TTFT percentiles, from a
  :func:`testbed.analysis.fleet.instance_table`.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

import numpy as np
import pandas as pd
from matplotlib import pyplot as plt
from matplotlib.figure import Figure

LOAD = "offered_tokens_per_s_per_instance"


def routers_figure(
    table: pd.DataFrame, title: str, group_by: Sequence[str] = ("router",)
) -> Figure:
    """Two panels sharing the x-axis (prompt tokens offered per second per instance): token
    hit rate and routing loss rate (%), one line per group of ``group_by``'s values."""
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.8), layout="constrained")
    figure.suptitle(textwrap.fill(title, 100))
    groups = table.groupby(list(group_by), sort=True, dropna=False)
    for (name, group), marker in zip(groups, "osD^v<>px*", strict=False):
        group = group.sort_values(LOAD)
        label = " · ".join(str(v) for v in (name if isinstance(name, tuple) else (name,)))
        for panel, metric in zip(axes, ("token_hit_rate", "routing_loss_rate"), strict=True):
            values = 100 * pd.to_numeric(group[metric], errors="coerce")
            panel.plot(group[LOAD], values, marker=marker, label=label)
    for panel, what in zip(
        axes, ("token hit rate (%)", "routing loss (% of prompt tokens)"), strict=True
    ):
        panel.set_xlabel("offered load (prompt tokens / s / instance)")
        panel.set_ylabel(what)
        panel.grid(True, alpha=0.3)
        panel.set_ylim(bottom=0)
    axes[0].legend(fontsize="small")
    return figure


def instance_figure(instances: pd.DataFrame, title: str) -> Figure:
    """Left: each instance's prompt tokens by source; right: its queueing and TTFT p50/p99."""
    figure, (tokens, times) = plt.subplots(1, 2, figsize=(12, 4.8), layout="constrained")
    figure.suptitle(textwrap.fill(title, 100))
    positions = np.arange(len(instances))
    computed = instances["prompt_tokens"] - instances["engine"] - instances["external"]
    bottom = np.zeros(len(instances))
    for values, label, color in (
        (instances["engine"], "engine (its prefix cache)", "tab:blue"),
        (instances["external"], "external (cache server)", "tab:green"),
        (computed, "computed", "tab:gray"),
    ):
        tokens.bar(
            positions, values.to_numpy(dtype=float) / 1e3, bottom=bottom, label=label, color=color
        )
        bottom += values.to_numpy(dtype=float) / 1e3
    tokens.set_ylabel("prompt tokens (thousands)")
    tokens.legend(fontsize="small")
    width = 0.2
    for offset, column in zip(
        (-1.5, -0.5, 0.5, 1.5),
        ("queueing_p50_ms", "queueing_p99_ms", "ttft_p50_ms", "ttft_p99_ms"),
        strict=True,
    ):
        values = pd.to_numeric(instances[column], errors="coerce").fillna(0)
        times.bar(positions + offset * width, values, width, label=column.replace("_", " "))
    times.set_ylabel("ms (engine clock)")
    times.legend(fontsize="small")
    for panel in (tokens, times):
        panel.set_xticks(positions, [f"instance {i}" for i in instances["instance"]])
        panel.grid(True, axis="y", alpha=0.3)
    return figure
