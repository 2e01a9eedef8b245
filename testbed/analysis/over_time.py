"""Hit rates over time, per request group and per run, and the cache server's timeline drawn.

Requests are placed on the **workload clock**, their ``arrival_s`` (the trace's or
generator's arrival time); :mod:`testbed.analysis.cache_timeline` puts the server's evictions
and bytes in use on the same clock, so that the figures line up.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping

import numpy as np
import pandas as pd
from matplotlib import pyplot as plt
from matplotlib.figure import Figure

from testbed.analysis.cache_timeline import CacheTimeline
from testbed.analysis.figure_frame import new_figure, no_data
from testbed.analysis.per_request import hit_shares

MIB = 2**20
_REASON_STYLES = {"capacity": "-", "drop": "--"}


def hit_rate_over_time(requests: pd.DataFrame, bins: int = 12) -> pd.DataFrame:
    """Token-weighted hit rates in ``bins`` equal slices of the workload clock: ``start_s``,
    ``end_s``, ``time_s`` (the middle), ``requests``, ``prompt_tokens``, ``token_hit_rate``
    ((E + X) / P of the requests that arrived in the slice) and ``external_token_hit_rate``
    (X / P). Slices no request arrived in are left out (no rate is made up)."""
    columns = ["start_s", "end_s", "time_s", "requests", "prompt_tokens"]
    columns += ["token_hit_rate", "external_token_hit_rate"]
    if requests.empty or "arrival_s" not in requests:
        return pd.DataFrame(columns=columns)
    arrival = pd.to_numeric(requests["arrival_s"], errors="coerce")
    if arrival.isna().all():
        return pd.DataFrame(columns=columns)
    known = requests[arrival.notna()]
    arrival = arrival[arrival.notna()].astype(float)
    low, high = float(arrival.min()), float(arrival.max())
    edges = np.linspace(low, high if high > low else low + 1.0, bins + 1)
    slot = np.clip(np.searchsorted(edges, arrival.to_numpy(), side="right") - 1, 0, bins - 1)
    grouped = known.groupby(slot)
    prompt = grouped["prompt_tokens"].sum().astype(float)
    engine = grouped["engine_hit_tokens"].sum()
    external = grouped["external_hit_tokens"].sum()
    slots = prompt.index.to_numpy()
    table = pd.DataFrame(
        {
            "start_s": edges[slots],
            "end_s": edges[slots + 1],
            "time_s": (edges[slots] + edges[slots + 1]) / 2,
            "requests": grouped.size().to_numpy(),
            "prompt_tokens": prompt.astype("int64").to_numpy(),
            "token_hit_rate": ((engine + external) / prompt.clip(lower=1)).to_numpy(),
            "external_token_hit_rate": (external / prompt.clip(lower=1)).to_numpy(),
        }
    )
    return table[prompt.to_numpy() > 0].reset_index(drop=True)


def busiest_groups(requests: pd.DataFrame, top: int = 8) -> list[str]:
    """The ``top`` groups with the most requests (ties: the earliest first), in the order of
    their first request."""
    shares = hit_shares(requests)
    counts = shares.groupby("group", sort=False).agg(
        requests=("request_id", "size"), first=("arrival_s", "min")
    )
    chosen = counts.sort_values(["requests", "first"], ascending=[False, True]).head(top)
    return list(chosen.sort_values("first", kind="stable").index)


# ---------------------------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------------------------


def group_hit_rate_figure(requests: pd.DataFrame, title: str, top: int = 8) -> Figure:
    """Each request's hit share at its arrival: a line per busiest group (its requests in
    order: a conversation's turns), the other requests as grey dots, and the token-weighted
    hit rate of all requests per time slice (black)."""
    figure, axes = new_figure(title, (10, 5.5), 90)
    shares = hit_shares(requests).sort_values("arrival_s", kind="stable")
    chosen = busiest_groups(requests, top)
    rest = shares[~shares["group"].isin(chosen)]
    if len(rest):
        axes.plot(
            rest["arrival_s"],
            rest["hit_share"] * 100,
            "o",
            color="0.75",
            markersize=4,
            label=f"other groups ({rest['group'].nunique()})",
        )
    for group in chosen:
        rows = shares[shares["group"] == group]
        axes.plot(
            rows["arrival_s"],
            rows["hit_share"] * 100,
            marker="o",
            lw=1,
            markersize=4,
            label=str(group),
        )
    overall = hit_rate_over_time(requests)
    axes.plot(
        overall["time_s"],
        overall["token_hit_rate"] * 100,
        color="black",
        lw=2.5,
        label="all requests (per time slice)",
    )
    axes.set_xlabel("arrival time (s, workload clock)")
    axes.set_ylabel("hit share: (engine + external) / prompt (%)")
    axes.set_ylim(0, 105)
    axes.legend(fontsize="x-small", loc="center left", bbox_to_anchor=(1.0, 0.5))
    return figure


def hit_rate_over_time_figure(
    tables: Mapping[str, pd.DataFrame], title: str, bins: int = 12
) -> Figure:
    """Per run (``tables``: label → per-request table): the token hit rate of the requests
    arriving in each time slice (solid) and the external cache's part of it (dotted)."""
    figure, axes = new_figure(title, (10, 5.5), 90)
    colours = _colours()
    for number, (label, requests) in enumerate(tables.items()):
        over = hit_rate_over_time(requests, bins)
        colour = colours[number % len(colours)]
        axes.plot(
            over["time_s"],
            over["token_hit_rate"] * 100,
            marker="o",
            color=colour,
            label=f"{label}: all hits",
        )
        axes.plot(
            over["time_s"],
            over["external_token_hit_rate"] * 100,
            linestyle=":",
            marker=".",
            color=colour,
            label=f"{label}: external",
        )
    axes.set_xlabel("arrival time (s, workload clock)")
    axes.set_ylabel("token hit rate of the requests arriving then (%)")
    axes.set_ylim(0, 105)
    axes.legend(fontsize="x-small", loc="center left", bbox_to_anchor=(1.0, 0.5))
    return figure


def evictions_figure(timelines: Mapping[str, CacheTimeline], title: str) -> Figure:
    """Per run: bytes in use (top, capacity dashed) and bytes evicted so far (bottom, one
    line per reason: capacity solid, drop dashed), on the workload clock when every run has
    it."""
    figure, (used, evicted) = plt.subplots(2, 1, figsize=(10, 7), sharex=True, layout="constrained")
    figure.suptitle(textwrap.fill(title, 90))
    clock = "arrival_s" if all(t.clock == "arrival_s" for t in timelines.values()) else "run_s"
    colours = _colours()
    for number, (label, timeline) in enumerate(timelines.items()):
        colour = colours[number % len(colours)]
        usage = timeline.usage
        if len(usage):
            used.step(
                usage[clock], usage["used_bytes"] / MIB, where="post", color=colour, label=label
            )
        if timeline.capacity_bytes:
            used.axhline(timeline.capacity_bytes / MIB, color=colour, linestyle="--", lw=1)
        for reason, rows in timeline.evictions.groupby("reason", sort=False):
            evicted.step(
                rows[clock],
                rows["cumulative_bytes"] / MIB,
                where="post",
                color=colour,
                linestyle=_REASON_STYLES.get(str(reason), "-."),
                marker=".",
                label=f"{label}: {reason} ({int(rows['objects'].sum())} objects)",
            )
    if not any(len(t.evictions) for t in timelines.values()):
        no_data(evicted, "no evictions: nothing was removed from the cache")
    if not any(len(t.usage) for t in timelines.values()):
        no_data(used, "no server span reported the bytes in use")
    used.set_ylim(bottom=0)
    evicted.set_ylim(bottom=0)
    used.set_ylabel("bytes in use (MiB; capacity dashed)")
    evicted.set_ylabel("bytes evicted so far (MiB)")
    evicted.set_xlabel(
        "arrival time of the latest admitted request (s, workload clock)"
        if clock == "arrival_s"
        else "time since the run's first span (s, wall clock)"
    )
    for axes in (used, evicted):
        axes.grid(True, alpha=0.3)
        if axes.get_legend_handles_labels()[0]:
            axes.legend(fontsize="x-small", loc="upper left")
    return figure


def _colours() -> list[str]:
    return list(plt.rcParams["axes.prop_cycle"].by_key()["color"])
