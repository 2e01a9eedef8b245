"""Fleet figures: where requests went, each instance's load, balance and routing loss.

Everything comes from a run's per-request table (``metrics.parquet``: the attribution with the
engine's arrival, first-scheduled and first-token times on its clock) joined with its
``kvcache.route`` spans (:func:`testbed.analysis.routing.route_table`). METRICS.md ("Fleets")
defines each figure:

- :func:`fleet_requests`: the per-request table with ``instance``, ``router`` and the
  ``queueing_ms`` of each request (first scheduled − arrival);
- :func:`instance_table`: one row per instance (requests, prompt tokens, hits, routing loss,
  queueing and TTFT percentiles);
- :func:`fleet_summary`: the run's scalar fleet figures (:func:`routed_summary`: in
  summary.json when the run routed its requests);
- :func:`router_table`: runs side by side (a sweep's or any run directories'), one row each.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from testbed.analysis.routing import route_table, won_back
from testbed.analysis.source import Source
from testbed.analysis.tables import Run

ROUTER_COLUMNS = (
    "router",
    "instances",
    "offered_tokens_per_s_per_instance",
    "requests",
    "token_hit_rate",
    "engine_hit_rate",
    "external_hit_rate",
    "p2p_hit_rate",
    "remote_hit_rate",
    "routing_loss_rate",
    "routing_won_back_rate",
    "load_imbalance",
    "queueing_p99_ms",
    "ttft_p50_ms",
    "ttft_p99_ms",
)


def fleet_requests(requests: pd.DataFrame, spans: pd.DataFrame) -> pd.DataFrame:
    """``requests`` (a run's per-request table) with the columns ``instance``, ``router``,
    ``cached_tokens`` (per instance, at the decision) and ``queueing_ms``. A run that routed
    nothing is a fleet of one: every request on instance 0, ``router`` null."""
    routes = route_table(spans)[["workload_request_id", "instance", "router", "cached_tokens"]]
    table = requests.merge(routes, on="workload_request_id", how="left")
    if routes.empty:
        table["instance"] = 0
        table["cached_tokens"] = [[0] for _ in range(len(table))]
    table["instance"] = table["instance"].astype("Int64")
    queued = table.get("scheduled_s", pd.Series(np.nan, index=table.index)) - table.get(
        "arrival_s", np.nan
    )
    table["queueing_ms"] = pd.to_numeric(queued, errors="coerce") * 1e3
    return table


def num_instances(table: pd.DataFrame) -> int:
    """The fleet's size: the length of the route spans' per-instance lists."""
    sizes = table["cached_tokens"].dropna().map(len)
    return int(sizes.max()) if len(sizes) else 1


def instance_table(table: pd.DataFrame) -> pd.DataFrame:
    """One row per instance of a :func:`fleet_requests` table, every instance of the fleet
    (also those that got nothing): ``requests``, ``prompt_tokens``, ``engine``, ``external``,
    ``routing`` (tokens), ``token_hit_rate``, ``queueing_p50_ms``, ``queueing_p99_ms``,
    ``ttft_p50_ms``, ``ttft_p99_ms``."""
    routed = table[table["instance"].notna()]
    groups = routed.groupby("instance")
    rows = pd.DataFrame(
        {
            "requests": groups.size(),
            "prompt_tokens": groups["prompt_tokens"].sum(),
            "engine": groups["engine"].sum(),
            "external": groups["external"].sum(),
            "routing": groups["routing"].sum(),
            "queueing_p50_ms": groups["queueing_ms"].quantile(0.5),
            "queueing_p99_ms": groups["queueing_ms"].quantile(0.99),
            "ttft_p50_ms": groups["ttft_ms"].quantile(0.5),
            "ttft_p99_ms": groups["ttft_ms"].quantile(0.99),
        }
    )
    everyone = pd.Index(range(num_instances(table)), name="instance")
    rows = rows.reindex(everyone)
    counts = ["requests", "prompt_tokens", "engine", "external", "routing"]
    rows[counts] = rows[counts].fillna(0).astype("int64")
    hits = rows["engine"] + rows["external"]
    rows["token_hit_rate"] = hits / rows["prompt_tokens"].where(rows["prompt_tokens"] > 0)
    return rows.reset_index()


def fleet_summary(table: pd.DataFrame) -> dict[str, Any]:
    """The scalar fleet figures of a :func:`fleet_requests` table (METRICS.md, "Fleets")."""
    per_instance = instance_table(table)
    tokens = per_instance["prompt_tokens"].astype(float)
    mean = tokens.mean()
    prompt = int(table["prompt_tokens"].sum())
    arrivals = table["arrival_s"] if "arrival_s" in table else pd.Series(dtype=float)
    span_s = float(arrivals.max() - arrivals.min()) if len(arrivals) else 0.0
    queueing = table["queueing_ms"].dropna()
    return {
        "instances": len(per_instance),
        "routing_tokens": int(table["routing"].sum()) if "routing" in table else 0,
        "routing_won_back_tokens": int(won_back(table).sum()),
        "routing_loss_rate": int(table["routing"].sum()) / prompt
        if prompt and "routing" in table
        else 0.0,
        "load_imbalance": float(tokens.max() / mean) if mean else None,
        "load_cv": float(tokens.std(ddof=0) / mean) if mean else None,
        "queueing_p50_ms": float(queueing.quantile(0.5)) if len(queueing) else None,
        "queueing_p99_ms": float(queueing.quantile(0.99)) if len(queueing) else None,
        "offered_tokens_per_s_per_instance": (
            prompt / span_s / len(per_instance) if span_s > 0 else None
        ),
    }


def routed_summary(requests: pd.DataFrame, spans: pd.DataFrame) -> dict[str, Any]:
    """summary.json's fleet figures: :func:`fleet_summary` for a run that routed its requests
    (a fleet, or the serve engine over several servers), nothing for any other run."""
    table = fleet_requests(requests, spans)
    return fleet_summary(table) if table["router"].notna().any() else {}


def fleet_run(source: Source) -> Run:
    """The run a figure of one fleet shows: the source's first measured run that routed its
    requests, else its first measured run (a fleet of one)."""
    measured = source.measured
    routed = measured["engine"].eq("fleet")
    if "instances" in measured:
        routed |= measured["instances"].fillna(1).astype(int) > 1
    if routed.any():
        return source.run(str(measured.loc[routed, "run_id"].iloc[0]))
    return source.measured_run()


def run_fleet_table(run: Run | Path | str) -> pd.DataFrame:
    """:func:`fleet_requests` of a finished run directory."""
    run = run if isinstance(run, Run) else Run(Path(run))
    return fleet_requests(run.requests, run.spans)


def router_table(runs: Mapping[str, Path | str]) -> pd.DataFrame:
    """One row per run (``label`` → run directory): :data:`ROUTER_COLUMNS`, from the run's
    spec, summary and :func:`fleet_summary` (a run that routed nothing: router ``-``, one
    instance). Engine, external, ``p2p`` (a peer's copies) and ``remote`` (the remote tier's)
    hit rates and the routing loss won back by peers are shares of the prompt tokens."""
    rows = []
    for label, path in runs.items():
        run = Run(Path(path))
        summary, spec = run.summary, run.spec
        figures = fleet_summary(run_fleet_table(run))
        prompt = summary.get("prompt_tokens") or 0
        tokens = summary.get("tokens") or {}
        routed = spec.get("engine") == "fleet" or spec.get("instances", 1) > 1
        rows.append(
            {
                "label": label,
                "router": spec.get("router") if routed else "-",
                "instances": figures["instances"],
                "offered_tokens_per_s_per_instance": figures["offered_tokens_per_s_per_instance"],
                "requests": summary.get("requests"),
                "token_hit_rate": summary.get("token_hit_rate"),
                "engine_hit_rate": _share(summary.get("engine_hit_tokens"), prompt),
                "external_hit_rate": _share(summary.get("external_hit_tokens"), prompt),
                "p2p_hit_rate": _share(tokens.get("external_p2p"), prompt),
                "remote_hit_rate": _share(tokens.get("external_remote"), prompt),
                "routing_loss_rate": figures["routing_loss_rate"],
                "routing_won_back_rate": _share(figures["routing_won_back_tokens"], prompt),
                "load_imbalance": figures["load_imbalance"],
                "queueing_p99_ms": figures["queueing_p99_ms"],
                "ttft_p50_ms": summary.get("ttft_p50_ms"),
                "ttft_p99_ms": summary.get("ttft_p99_ms"),
            }
        )
    return pd.DataFrame(rows, columns=["label", *ROUTER_COLUMNS])


def _share(part: int | None, whole: int) -> float | None:
    return part / whole if part is not None and whole else None
