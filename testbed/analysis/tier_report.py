"""``kvtb report``'s tier figures: what a second tier bought, by tier, against its capacity.

For a sweep whose runs have tiers below L1 (run key ``tiers``): per run its L2 capacity (bytes,
from its spec), its write and promotion policies, and its external hits by tier (summary.json
``tokens``: ``external_host``, ``external_disk``). Two figures:

- ``tiers_hit_rate.png``: measured hit rate by tier against L2 capacity, a line per write
  policy; beside it the one-pass what-if of the inclusive LRU hierarchy over the same workload
  at the same capacities (oracle semantics: the external cache alone, no vLLM prefix cache);
- ``tiers_ttft.png``: the runs' mean projected TTFT with each request's hits by the tier that
  served them (:mod:`testbed.models.tier_time`, under ``h100`` and the ``gen5`` links, for the
  run's model or, when it has no compute shape, llama3-8b's; vLLM's own hits stay out of the
  prompt the projection computes).

Runs in the analysing process; reads run directories only.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from matplotlib import pyplot as plt
from matplotlib.figure import Figure

from testbed.analysis.whatif.runlog import run_spec
from testbed.models.links import tier_profile
from testbed.models.profiles import KVProfile, get_profile
from testbed.models.tier_time import tiered_ttft_s
from testbed.models.time_model import make_time_model

TIME_PROFILE, LINKS = "h100", "gen5"
STAND_IN = "llama3-8b"
FigureEntry = tuple[str, Figure, str]


def tier_runs(sweep_dir: Path, run_ids: list[str]) -> pd.DataFrame:
    """One row per run with a tier below L1: ``run_id``, ``tier_write``, ``tier_promote``,
    ``l1_capacity_tokens``, ``l2_capacity_bytes``, ``l2_capacity_tokens``, hit rates by tier
    and the mean projected TTFT (ms) with and without the run's hits."""
    from server.tiers.spec import parse_tier

    rows = []
    for run_id in run_ids:
        run_dir = sweep_dir / run_id
        spec = run_spec(run_dir)
        if not spec.tiers or not (run_dir / "summary.json").is_file():
            continue
        summary = json.loads((run_dir / "summary.json").read_text())
        tokens, prompt = summary["tokens"], max(int(summary["prompt_tokens"]), 1)
        l2_bytes = parse_tier(spec.tiers[0]).capacity_bytes
        per_token = int(summary.get("bytes_per_token") or 1)
        rows.append(
            {
                "run_id": run_id,
                "tier_write": spec.tier_write,
                "tier_promote": spec.tier_promote,
                "l1_capacity_tokens": spec.capacity_tokens,
                "l2_capacity_bytes": l2_bytes,
                "l2_capacity_tokens": l2_bytes // per_token,
                "host_hit_rate": tokens.get("external_host", 0) / prompt,
                "disk_hit_rate": tokens.get("external_disk", 0) / prompt,
                "external_hit_rate": tokens.get("external", 0) / prompt,
                **_ttft(run_dir, spec),
            }
        )
    return pd.DataFrame(rows)


def projection_profile(spec: Any) -> KVProfile:
    """The model the projection costs: the run's, or :data:`STAND_IN` when the run's has no
    compute shape (the tiny replay model): token counts are the run's, times a real model's."""
    return spec.kv_profile if spec.kv_profile.has_compute_shape else get_profile(STAND_IN)


def _ttft(run_dir: Path, spec: Any) -> dict[str, Any]:
    requests = pd.read_parquet(run_dir / "metrics.parquet")
    profile = projection_profile(spec)
    model = make_time_model(TIME_PROFILE, profile, tp=spec.tp, chunk_size=spec.chunk_size)
    links = tier_profile(LINKS)
    size = profile.bytes_per_token(spec.tp)
    prompts = (requests["prompt_tokens"] - requests["engine_hit_tokens"]).to_numpy(np.float64)
    hits = {
        source: requests[f"external_{source}"].to_numpy(np.float64)
        for source in ("host", "disk")
        if f"external_{source}" in requests
    }
    with_hits = tiered_ttft_s(model, links, prompts, hits, bytes_per_token=size)
    without = tiered_ttft_s(model, links, prompts, {}, bytes_per_token=size)
    return {
        "ttft_mean_ms": 1e3 * float(with_hits.mean()),
        "ttft_no_cache_mean_ms": 1e3 * float(without.mean()),
        "projected_profile": profile.name,
    }


def one_pass_beside(sweep_dir: Path, runs: pd.DataFrame) -> pd.DataFrame:
    """The one-pass what-if of the inclusive LRU hierarchy over the first run's workload, at
    the runs' L1 and L2 capacities (tokens): :func:`testbed.analysis.whatif.tiers.tier_table`
    rows, with ``l2_capacity_bytes`` as the runs have it."""
    from testbed.analysis.whatif import WhatIfOptions, what_if_workload
    from testbed.analysis.whatif.tiers import TierGrid

    spec = run_spec(sweep_dir / runs["run_id"].iloc[0])
    per_token = dict(zip(runs["l2_capacity_tokens"], runs["l2_capacity_bytes"], strict=False))
    grid = TierGrid(
        tuple(int(t) for t in runs["l1_capacity_tokens"].dropna().unique()),
        tuple(int(t) for t in per_token),
        belady=False,
    )
    whatif = what_if_workload(spec, WhatIfOptions(policies=("lru",), tiers=grid))
    table = whatif.tiers if whatif.tiers is not None else pd.DataFrame()
    return table.assign(l2_capacity_bytes=table["l2_capacity_tokens"].map(per_token))


def tier_report_figures(sweep_dir: Path, run_ids: list[str], context: str) -> list[FigureEntry]:
    """The tier figures of a sweep (``[]`` when no run has a tier below L1)."""
    runs = tier_runs(sweep_dir, run_ids)
    if runs.empty:
        return []
    beside = one_pass_beside(sweep_dir, runs) if runs["l1_capacity_tokens"].notna().all() else None
    return [
        (
            "tiers_hit_rate.png",
            _hit_rate_figure(runs, beside, f"Hit rate by tier against L2 capacity — {context}"),
            "External hit rate served by L1 (host, dotted), L2 (disk, dashed) and both "
            "(solid), measured, against the disk tier's capacity, a line per write policy; in "
            "grey the one-pass what-if of the inclusive LRU hierarchy over the same workload "
            "(the external cache alone, whole chunks: an upper reference, not a fit).",
        ),
        (
            "tiers_ttft.png",
            _ttft_figure(runs, f"Projected TTFT by tier — {context}"),
            f"Mean projected TTFT ({runs['projected_profile'].iloc[0]} on {TIME_PROFILE}, "
            f"links {LINKS}) with each request's hits "
            "costed by the tier that served them (a disk hit pays its read into L1 before the "
            "host copy), against L2 capacity; the cache-less TTFT dotted.",
        ),
    ]


def _hit_rate_figure(runs: pd.DataFrame, beside: pd.DataFrame | None, title: str) -> Figure:
    figure, axes = plt.subplots(figsize=(9, 5.5), layout="constrained")
    axes.set_title(textwrap.fill(title, 90))
    styles = {"host_hit_rate": ":", "disk_hit_rate": "--", "external_hit_rate": "-"}
    names = {
        "host_hit_rate": "L1 (host)",
        "disk_hit_rate": "L2 (disk)",
        "external_hit_rate": "total",
    }
    if beside is not None and not beside.empty:
        rows = beside.sort_values("l2_capacity_bytes")
        for metric, column in (("host_hit_rate", "host_hit_rate"),
                               ("disk_hit_rate", "disk_hit_rate"),
                               ("external_hit_rate", "token_hit_rate")):  # fmt: skip
            axes.plot(rows["l2_capacity_bytes"], 100 * rows[column], styles[metric],
                      color="grey", label=f"what-if {names[metric]} (one pass)")  # fmt: skip
    for (write, promote), rows in runs.groupby(["tier_write", "tier_promote"]):
        rows = rows.sort_values("l2_capacity_bytes")
        for metric, style in styles.items():
            axes.plot(rows["l2_capacity_bytes"], 100 * rows[metric], style, marker="o",
                      label=f"{write}+{promote} {names[metric]} (measured)")  # fmt: skip
    _axes(axes, "external hit rate (% of prompt tokens)")
    axes.set_ylim(0, 100)
    return figure


def _ttft_figure(runs: pd.DataFrame, title: str) -> Figure:
    figure, axes = plt.subplots(figsize=(9, 5.5), layout="constrained")
    axes.set_title(textwrap.fill(title, 90))
    for (write, promote), rows in runs.groupby(["tier_write", "tier_promote"]):
        rows = rows.sort_values("l2_capacity_bytes")
        axes.plot(rows["l2_capacity_bytes"], rows["ttft_mean_ms"], "-o",
                  label=f"{write}+{promote}")  # fmt: skip
    axes.axhline(runs["ttft_no_cache_mean_ms"].iloc[0], linestyle=":", color="grey",
                 label="no external cache")  # fmt: skip
    model = runs["projected_profile"].iloc[0]
    _axes(axes, f"mean projected TTFT (ms; {model} on {TIME_PROFILE}, links {LINKS})")
    axes.set_ylim(bottom=0)
    return figure


def _axes(axes: plt.Axes, ylabel: str) -> None:
    axes.set_xscale("log", base=2)
    axes.set_xlabel("L2 (disk tier) capacity (bytes)")
    axes.set_ylabel(ylabel)
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize="x-small")
