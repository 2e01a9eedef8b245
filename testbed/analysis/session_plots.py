"""Figures of sessions (:mod:`testbed.analysis.sessions`): the distribution of per-conversation
hit rates beside the published one, the hit rate by turn, and how contexts grow."""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from testbed.analysis import sessions
from testbed.analysis.figure_frame import new_figure


def distribution_figure(
    requests: pd.DataFrame, title: str, reuse: pd.DataFrame | None = None
) -> Figure:
    """Cumulative distributions (share of groups at or below a rate) of the token hit rate per
    conversation and per agent, of the trace's consecutive-request reuse (``reuse``), and the
    published quantiles as diamonds."""
    figure, axes = new_figure(title, (9, 5))
    series = {
        "token hit rate per conversation": sessions.group_hit_rates(requests)["token_hit_rate"],
        "token hit rate per agent": sessions.group_hit_rates(requests, "group")["token_hit_rate"],
    }
    if reuse is not None and len(reuse):
        series["the trace: consecutive-request reuse"] = reuse["reuse"]
    for label, rates in series.items():
        values = np.sort(pd.to_numeric(rates, errors="coerce").dropna().to_numpy(dtype=float))
        shares = np.arange(1, len(values) + 1) / max(len(values), 1)
        axes.step(values * 100, shares * 100, where="post", lw=2, label=f"{label} ({len(values)})")
    published = sessions.PUBLISHED
    points = [published[key] * 100 for key in ("min", "p25", "median", "p75", "max")]
    axes.plot(points, [0, 25, 50, 75, 100], "D", color="black", label=str(published.name))
    axes.set_xlabel("hit rate (%)")
    axes.set_ylabel("groups at or below it (%)")
    axes.set_ylim(-2, 102)
    axes.legend(fontsize="small", loc="upper left")
    return figure


def turn_figure(requests: pd.DataFrame, title: str, max_turns: int = 50) -> Figure:
    """Token hit rate of the requests at each turn index (line), the middle half of their hit
    shares (band), and how many groups reach that turn (bars, right axis)."""
    figure, axes = new_figure(title, (9, 5))
    by_turn = sessions.hit_rate_by_turn(requests, max_turns)
    counts = axes.twinx()
    counts.bar(by_turn["turn"], by_turn["groups"], color="0.85", width=0.8, label="groups")
    counts.set_ylabel("groups with this turn")
    axes.set_zorder(counts.get_zorder() + 1)
    axes.patch.set_visible(False)
    axes.fill_between(
        by_turn["turn"],
        by_turn["hit_share_p25"] * 100,
        by_turn["hit_share_p75"] * 100,
        alpha=0.25,
        label="hit share, P25 to P75",
    )
    axes.plot(by_turn["turn"], by_turn["token_hit_rate"] * 100, marker="o", label="token hit rate")
    axes.set_xlabel("turn (0: a group's first request)")
    axes.set_ylabel("hit rate (%)")
    axes.set_ylim(0, 105)
    axes.legend(fontsize="small", loc="lower right")
    return figure


def context_growth_figure(requests: pd.DataFrame, title: str, top: int = 10) -> Figure:
    """Prompt tokens by turn: a line per group of the ``top`` with the most requests, the
    others as grey dots."""
    figure, axes = new_figure(title, (9, 5))
    table = sessions.turns(requests)
    sizes = table.groupby("group").size().sort_values(ascending=False, kind="stable")
    chosen = list(sizes.index[:top])
    rest = table[~table["group"].isin(chosen)]
    if len(rest):
        axes.plot(rest["turn"], rest["prompt_tokens"], ".", color="0.7", label="other groups")
    for group in chosen:
        rows = table[table["group"] == group].sort_values("turn")
        axes.plot(rows["turn"], rows["prompt_tokens"], marker=".", lw=1, label=str(group))
    axes.set_xlabel("turn (0: a group's first request)")
    axes.set_ylabel("prompt tokens")
    axes.legend(fontsize="x-small", loc="center left", bbox_to_anchor=(1.0, 0.5))
    return figure
