"""``kvtb report runs/<sweep>``: a sweep's comparison table and figures.

Writes ``<sweep>/report/``: ``report.md`` (what was run, whether its traces were sampled, the
comparison table, the figures), ``runs.csv`` and PNG figures, the what-if first:

- ``whatif_hit_rate.png``, ``whatif_min_capacity.png``, ``whatif_reuse.png`` (sweeps that vary
  capacity or policy): what the external cache buys at every capacity: the measured runs on the
  exact LRU curve of the accesses a run recorded, above vLLM's own share, and the oracle runs
  on the workload's curve beside Belady, a row per workload; the minimum-capacity gauge and
  reuse CDFs (:mod:`testbed.analysis.capacity_whatif`);
- ``hit_rate.png``: token hit rate against the swept parameter, oracle bounds dashed beside
  the measured runs; ``request_hit_rate.png`` the same, request-weighted;
- ``token_sources.png``: prompt tokens from the engine's prefix cache, the external cache,
  recomputed, per run;
- ``latency_cdf.png``: CDFs of lookup, store and retrieve latency (connector side), per run;
- ``bytes.png``: bytes stored, retrieved and evicted per run;
- ``lock_hold.png``: how long read locks were held, per run;
- ``bytes_per_rank.png``: bytes stored per KV rank (when TP or MLA vary);
- ``token_causes.png``: where every prompt token went, per run (the categories of
  METRICS.md), beside the miss-cause table (3C table) in ``report.md``.
- ``tiers_hit_rate.png``, ``tiers_ttft.png`` (runs with a tier below L1): hit rate by tier and
  projected TTFT by tier against L2 capacity (:mod:`testbed.analysis.tier_report`);
- ``fleet_routers.png`` (sweeps with fleet runs): token hit rate and routing loss against the
  offered load per instance, per router, beside the Routers table in ``report.md``.

Token categories take :mod:`testbed.analysis.palette`'s colours in every figure.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib
import pandas as pd
from matplotlib.figure import Figure

from testbed.analysis import (
    attribution_plots,
    capacity_whatif,
    fleet,
    fleet_plots,
    metrics,
    plots,
    tier_report,
)
from testbed.analysis.headline import headline
from testbed.analysis.spans import load_spans
from testbed.analysis.tables import figure_axes
from testbed.core.telemetry import attributes as a
from testbed.sweep.index import COMPLETE, build_index, read_manifest

TABLE_COLUMNS = [
    "summary_requests",
    "requests_rejected",
    "token_hit_rate",
    "external_token_hit_rate",
    "mean_request_hit_rate",
    "engine_hit_tokens",
    "external_hit_tokens",
    "recomputed_tokens",
    "stored_bytes",
    "retrieved_bytes",
    "evicted_bytes",
    "integrity_errors",
    "lookup_p50_ms",
    "store_p50_ms",
    "retrieve_p50_ms",
    "spans_dropped",
]
_MAX_CDF_RUNS = 12


def write_report(sweep_dir: Path) -> Path:
    """Writes the report of ``sweep_dir``; returns the path of ``report.md``."""
    matplotlib.use("Agg")  # files only, no display
    sweep_dir = Path(sweep_dir)
    manifest = read_manifest(sweep_dir)
    index = build_index(sweep_dir)
    runs = index[index["status"] == COMPLETE].copy()
    if runs.empty:
        raise ValueError(f"{sweep_dir} has no finished runs to report on (run `kvtb sweep` first)")
    x, series = figure_axes(manifest["swept"], index)
    swept = [x, *series] if x in runs else series
    runs["label"] = runs.apply(lambda row: _label(row, swept), axis=1)
    runs = runs.sort_values([x, *series, "engine"], kind="stable")
    out = sweep_dir / "report"
    out.mkdir(exist_ok=True)
    context = _context(manifest, runs, swept)
    figures = _figures(sweep_dir, runs, x, series, swept, context)
    measured = runs[runs["engine"] != "oracle"]
    causes = attribution_plots.tokens_by_run(
        {row.label: sweep_dir / row.run_id for row in measured.itertuples()}
    )
    if len(causes):
        figures.append(
            (
                "token_causes.png",
                attribution_plots.where_tokens_went(
                    causes, "label", f"Where every prompt token went — {context}"
                ),
                "Every prompt token of every request in one category (METRICS.md): hits in "
                "vLLM's prefix cache or the cache server, or the cause of its miss.",
            )
        )
    routers = _routers(sweep_dir, measured, swept)
    if routers is not None:
        group_by = ["router", *[k for k in swept if k not in ("router", "instances")]]
        figures.append(
            (
                "fleet_routers.png",
                fleet_plots.routers_figure(routers, f"Routers against load — {context}", group_by),
                "Token hit rate and routing loss (prompt tokens another instance's prefix cache "
                "held at the decision, computed on the chosen one) against the prompt tokens "
                "offered per second per instance, per router (METRICS.md, Fleets).",
            )
        )
    for name, figure, _ in figures:
        figure.savefig(out / name, dpi=110)
        plots.close(figure)
    table = runs[["run_id", "engine", *swept, *[c for c in TABLE_COLUMNS if c in runs]]]
    table.to_csv(out / "runs.csv", index=False)
    report = out / "report.md"
    captions = [(name, caption) for name, _, caption in figures]
    misses = attribution_plots.miss_cause_table(causes) if len(causes) else None
    sentence = headline(runs)
    text = _markdown(manifest, context, table, captions, index, misses, sentence)
    report.write_text(text + (_routers_section(routers) if routers is not None else ""))
    return report


def _figures(
    sweep_dir: Path, runs: pd.DataFrame, x: str, series: list[str], swept: list[str], context: str
) -> list[tuple[str, Figure, str]]:
    """(file name, figure, caption) of every figure the sweep supports."""
    figures = capacity_whatif.report_figures(sweep_dir, swept, context)  # first, when it applies
    figures += _hit_rate_figures(runs, x, series, context)
    measured = runs[runs["engine"] != "oracle"]
    if measured.empty:
        return figures
    figures += tier_report.tier_report_figures(sweep_dir, list(measured["run_id"]), context)
    spans = {row.label: load_spans(sweep_dir / row.run_id) for row in measured.itertuples()}
    figures += _measured_figures(measured, spans, context)
    if {"tp", "mla"} & set(swept):
        figures.append(_bytes_per_rank_figure(spans, context))
    return figures


def _hit_rate_figures(
    runs: pd.DataFrame, x: str, series: list[str], context: str
) -> list[tuple[str, Figure, str]]:
    """Token and per-request hit rates against the swept parameter (every run)."""
    return [
        (
            "hit_rate.png",
            plots.hit_rate(runs, x, series, title=f"Token hit rate — {context}"),
            "Token hit rate (vLLM's prefix cache + the external cache) against the swept "
            "parameter. Dashed: the oracle, the external cache alone at chunk granularity; "
            "vLLM's own cache works in blocks and can add hits beyond it.",
        ),
        (
            "request_hit_rate.png",
            plots.hit_rate(
                runs,
                x,
                series,
                metric="mean_request_hit_rate",
                title=f"Mean per-request hit rate — {context}",
            ),
            "Mean per-request hit rate, request-weighted.",
        ),
    ]


def _measured_figures(
    measured: pd.DataFrame, spans: dict[str, pd.DataFrame], context: str
) -> list[tuple[str, Figure, str]]:
    """What the measured runs' telemetry shows: token sources, operation latencies, bytes
    moved and read-lock hold times (``spans``: each run's, by its label)."""
    holds = {
        label: metrics.lock_hold_times(frame)["hold_ms"].tolist() for label, frame in spans.items()
    }
    moved = {"stored_bytes": "stored", "retrieved_bytes": "retrieved", "evicted_bytes": "evicted"}
    return [
        (
            "token_sources.png",
            plots.token_breakdown(measured, "label", f"Where prompt tokens came from — {context}"),
            "Prompt tokens per measured run: from vLLM's own prefix cache, from the external "
            "cache, recomputed.",
        ),
        (
            "latency_cdf.png",
            plots.latency_cdf(_latencies(spans), f"Cache operation latency — {context}"),
            "Connector-side latency of lookups, stores and retrieves (CDF, log scale).",
        ),
        (
            "bytes.png",
            plots.grouped_bars(
                measured,
                "label",
                moved,
                "MiB",
                f"Bytes moved by the cache — {context}",
                scale=2**20,
            ),
            "Bytes stored, retrieved and evicted per run.",
        ),
        (
            "lock_hold.png",
            plots.distributions(
                holds, "lock hold time (ms, log scale)", f"Read-lock hold time — {context}"
            ),
            "How long lookups' read locks were held before a retrieve, free or TTL released them.",
        ),
    ]


def _bytes_per_rank_figure(spans: dict[str, pd.DataFrame], context: str) -> tuple[str, Figure, str]:
    per_rank = _bytes_per_rank(spans)
    ranks = {c: c for c in per_rank.columns if c != "label"}
    return (
        "bytes_per_rank.png",
        plots.grouped_bars(
            per_rank, "label", ranks, "MiB", f"Bytes stored per KV rank — {context}", scale=2**20
        ),
        "Bytes each KV rank stored: TP shards the heads; MLA stores one latent copy (rank 0).",
    )


def _routers(sweep_dir: Path, measured: pd.DataFrame, swept: list[str]) -> pd.DataFrame | None:
    """The router table of the sweep's fleet runs (with their swept keys); ``None`` without."""
    routed = measured["engine"].eq("fleet")
    if "instances" in measured:
        routed |= measured["instances"].fillna(1).astype(int) > 1
    fleets = measured[routed]
    if fleets.empty:
        return None
    table = fleet.router_table({row.label: sweep_dir / row.run_id for row in fleets.itertuples()})
    for key in swept:
        if key not in table and key in fleets:
            table[key] = fleets[key].to_numpy()
    return table


def _routers_section(routers: pd.DataFrame) -> str:
    """The fleet runs' table (METRICS.md, Fleets): hit rates, routing loss, balance, TTFT."""

    def pct(value: Any) -> str:
        return f"{float(value):.2%}" if pd.notna(value) else ""

    def ms(value: Any) -> str:
        return f"{float(value):.0f}" if pd.notna(value) else ""

    shown = pd.DataFrame(
        {
            "run": routers["label"],
            "router": routers["router"],
            "instances": routers["instances"],
            "token hit rate (engine / external)": [
                f"{pct(r.token_hit_rate)} ({pct(r.engine_hit_rate)} / {pct(r.external_hit_rate)})"
                for r in routers.itertuples()
            ],
            "p2p / remote": [
                f"{pct(r.p2p_hit_rate)} / {pct(r.remote_hit_rate)}" for r in routers.itertuples()
            ],
            "routing loss": routers["routing_loss_rate"].map(pct),
            "won back by peers": routers["routing_won_back_rate"].map(pct),
            "load imbalance (max/mean)": routers["load_imbalance"].map(
                lambda v: f"{v:.3f}" if pd.notna(v) else ""
            ),
            "queueing p99 ms": routers["queueing_p99_ms"].map(ms),
            "TTFT p50 / p99 ms": [
                f"{ms(r.ttft_p50_ms)} / {ms(r.ttft_p99_ms)}" for r in routers.itertuples()
            ],
        }
    )
    return "\n".join(
        [
            "",
            "## Routers",
            "",
            "Fleet runs (METRICS.md, Fleets), as shares of the prompt tokens: token hit rate with "
            "its engine and external parts, the part of the external hits a peer's copy (`p2p`) "
            "and the remote tier served, routing loss (what no cache won back) and the routing "
            "loss peers won back; then the busiest instance's prompt tokens over the mean, "
            "queueing and projected TTFT on the engine clock. A router's rows side by side say "
            "what P2P or a remote tier buys behind it.",
            "",
            _markdown_table(shown),
            "",
        ]
    )


def _label(row: pd.Series, swept: list[str]) -> str:
    parts = [str(row["engine"])] + [f"{k}={_value_label(k, row[k])}" for k in swept]
    return " ".join(parts)


def _value_label(key: str, value: object) -> str:
    if key.startswith("capacity") and pd.isna(value):
        return "unlimited"  # a run without a capacity limit
    return plots.short_label(value)


def _context(manifest: dict, runs: pd.DataFrame, swept: list[str]) -> str:
    fixed = []
    for key in ("workload", "requests", "chunk_size", "tp", "mla", "capacity_tokens", "policy"):
        if key not in swept and key in runs and runs[key].nunique(dropna=False) == 1:
            value = runs[key].iloc[0]
            if pd.isna(value):
                continue
            if key == "workload" and isinstance(value, str):
                value = value.split("/")[-1]
            fixed.append(f"{key}={value}")
    return f"{manifest['name']} ({', '.join(fixed[:4])})" if fixed else manifest["name"]


def _latencies(spans: dict[str, pd.DataFrame]) -> dict[str, dict[str, list[float]]]:
    chosen = dict(list(spans.items())[:_MAX_CDF_RUNS])
    return {
        operation: {
            label: frame.loc[frame["name"] == metrics.OPERATIONS[operation], "duration_ms"].tolist()
            for label, frame in chosen.items()
        }
        for operation in ("lookup", "store", "retrieve")
    }


def _bytes_per_rank(spans: dict[str, pd.DataFrame]) -> pd.DataFrame:
    rows = []
    for label, frame in spans.items():
        begins = frame[
            (frame["name"] == a.SERVER_STORE) & (metrics.column(frame, a.OP, "") == "store_begin")
        ]
        per_rank = (
            begins.groupby(a.KV_RANK)[a.BYTES].sum() if not begins.empty else pd.Series(dtype=float)
        )
        rows.append({"label": label, **{f"rank {int(r)}": float(b) for r, b in per_rank.items()}})
    return pd.DataFrame(rows).fillna(0.0)


def _markdown(
    manifest: dict,
    context: str,
    table: pd.DataFrame,
    figures: list[tuple[str, str]],
    index: pd.DataFrame,
    misses: pd.DataFrame | None = None,
    sentence: str | None = None,
) -> str:
    lines = [f"# Sweep report: {context}", ""]
    if manifest.get("description"):
        lines += [manifest["description"], ""]
    if sentence:
        lines += [f"**Headline.** {sentence}", ""]
    failed = index[index["status"] != COMPLETE]
    lines += [
        f"{len(table)} finished runs; {len(failed)} failed. "
        f"Swept: {', '.join(manifest['swept']) or 'nothing'}. {_sampling(index)}",
        "",
    ]
    shown = table.rename(columns={"summary_requests": "served", "requests_rejected": "rejected"})
    for column in shown.columns:
        if column.endswith("rate"):
            shown[column] = shown[column].map(lambda v: f"{v:.2%}" if pd.notna(v) else "")
        elif column.endswith("_ms"):
            shown[column] = shown[column].map(lambda v: f"{v:.3f}" if pd.notna(v) else "")
        elif pd.api.types.is_numeric_dtype(shown[column]) and not pd.api.types.is_bool_dtype(
            shown[column]
        ):
            shown[column] = shown[column].map(lambda v: f"{v:.0f}" if pd.notna(v) else "")
        elif column in ("workload",):
            shown[column] = shown[column].map(plots.short_label)
    lines += [_markdown_table(shown), ""]
    if len(failed):
        lines += (
            ["## Failed runs", ""]
            + [f"- `{r.run_id}`: {r.error}" for r in failed.itertuples()]
            + [""]
        )
    if misses is not None:
        lines += [
            "## Miss causes",
            "",
            "Prompt tokens the engine computed, by cause (METRICS.md), with each cause's share "
            "of them: the 3C table of cache studies, for KV reuse. `cold` is the compulsory "
            "miss and `capacity` the capacity miss; there are no conflict misses (the cache is "
            "fully associative); the other causes belong to a KV cache behind an engine.",
            "",
            _markdown_table(misses),
            "",
        ]
    lines += ["## Figures", ""]
    for name, caption in figures:
        lines += [f"![{caption}]({name})", "", f"*{caption}*", ""]
    return "\n".join(lines)


def _sampling(index: pd.DataFrame) -> str:
    """Whether every run recorded every trace; else which runs sampled, and how much of them
    their token figures are estimated from."""
    if "sampling_every_trace" not in index:
        return "No run says whether its traces were sampled (made before runs recorded it)."
    sampled = index[index["sampling_every_trace"].eq(False).fillna(False)]
    if sampled.empty:
        return "Every run recorded every trace: the token figures are exact."
    runs = "; ".join(
        f"`{row.run_id}` {row.sampling_text} ({row.requests_recorded} of "
        f"{row.summary_requests} requests)"
        for row in sampled.itertuples()
    )
    return f"Sampled runs, whose token figures are estimates from the requests recorded: {runs}."


def _markdown_table(frame: pd.DataFrame) -> str:
    rows = [[str(c) for c in frame.columns]]
    rows += [["" if pd.isna(v) else str(v) for v in row] for row in frame.itertuples(index=False)]
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(row) + " |" for row in rows[1:]]
    return "\n".join(lines)
