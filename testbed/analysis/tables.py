"""Derived tables: per request, per operation, per run (and per sweep in ``testbed.sweep``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import pandas as pd

from testbed.analysis.chunklog import has_chunk_log, load_chunk_log
from testbed.analysis.spans import load_events, load_spans
from testbed.core.run_dir import SUMMARY, RunDir, SweepDir
from testbed.core.telemetry import attributes as a

ENGINE_REQUEST_COLUMNS = {
    a.REQUEST_ID: "request_id",
    a.REQUEST_GROUP: "group",
    a.PROMPT_TOKENS: "prompt_tokens",
    a.OUTPUT_TOKENS: "output_tokens",
    a.ARRIVAL_S: "arrival_s",
    a.TTFT_MS: "ttft_ms",
    a.PREEMPTIONS: "preemptions",
}


def request_spans(spans: pd.DataFrame) -> pd.DataFrame:
    """The engine's own record of each workload request: one row per ``kvcache.request``
    span (``trace_id``, ``start_time``, ``duration_ms`` and the short names of
    :data:`ENGINE_REQUEST_COLUMNS`). It holds no hit counts; the per-request table, with every
    prompt token accounted for, is :attr:`Run.requests`."""
    requests = spans[spans["name"] == a.REQUEST]
    columns = ["trace_id", "start_time", "duration_ms", *ENGINE_REQUEST_COLUMNS]
    table = requests.reindex(columns=columns)
    return table.rename(columns=ENGINE_REQUEST_COLUMNS).reset_index(drop=True)


def operations_table(spans: pd.DataFrame) -> pd.DataFrame:
    """Cache operations on both sides: ``side`` (connector/server), ``op``, duration, status."""
    ops = spans[spans["name"].str.startswith(("kvcache.connector.", "kvcache.server."))].copy()
    parts = ops["name"].str.split(".", expand=True)
    ops.insert(0, "side", parts[1])
    ops.insert(1, "op", parts[2])
    return ops.reset_index(drop=True)


@dataclass(frozen=True)
class Run:
    """A run directory: its spec, summary and per-request table; spans, span events and the
    chunk log loaded on demand.

    :attr:`requests` is *the* per-request table of the testbed (``metrics.parquet``): one
    row per request, the attribution of :mod:`testbed.analysis.attribution` (``E``, ``X``,
    ``L``, ``H`` and every token category) joined with the engine's facts (``arrival_s``,
    ``output_tokens``, ``ttft_ms``)."""

    path: Path

    @cached_property
    def spec(self) -> dict[str, Any]:
        return json.loads(RunDir(self.path).spec.read_text())

    @cached_property
    def summary(self) -> dict[str, Any]:
        return json.loads(RunDir(self.path).summary.read_text())

    @cached_property
    def requests(self) -> pd.DataFrame:
        """The per-request table, ``metrics.parquet`` (METRICS.md; ``testbed.run.summary``)."""
        return pd.read_parquet(RunDir(self.path).metrics)

    @cached_property
    def spans(self) -> pd.DataFrame:
        return load_spans(self.path)

    @cached_property
    def events(self) -> pd.DataFrame:
        return load_events(self.path)

    @cached_property
    def chunks(self) -> pd.DataFrame | None:
        """The chunk event log (:mod:`testbed.analysis.chunklog`); ``None`` when no server
        wrote one into this run directory."""
        return load_chunk_log(self.path) if has_chunk_log(self.path) else None


def load_run(path: Path | str) -> Run:
    path = Path(path)
    if not RunDir(path).is_complete():
        raise FileNotFoundError(f"{path} is not a finished run directory (no {SUMMARY})")
    return Run(path)


def load_sweep_index(sweep_dir: Path | str) -> pd.DataFrame:
    """A sweep's ``index.parquet`` (one row per run: parameters and summary metrics)."""
    path = SweepDir(Path(sweep_dir)).index
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: run `kvtb sweep` on the sweep file first")
    return pd.read_parquet(path)


def compare_to_oracle(
    index: pd.DataFrame, keys: list[str], metric: str = "token_hit_rate"
) -> pd.DataFrame:
    """Each measured run's ``metric`` beside the oracle run with the same ``keys``, and the gap."""
    complete = index[index["status"] == "complete"] if "status" in index else index
    measured = complete[complete["engine"] != "oracle"]
    oracle = complete[complete["engine"] == "oracle"][[*keys, metric]].rename(
        columns={metric: "oracle"}
    )
    table = measured[["run_id", "engine", *keys, metric]].merge(oracle, on=keys, how="left")
    table["gap"] = table[metric] - table["oracle"]
    return table.reset_index(drop=True)


_X_PREFERENCE = (
    "chunk_size",
    "capacity_tokens",
    "capacity_bytes",
    "tp",
    "engine_blocks",
    "requests",
)


def figure_axes(swept: list[str], runs: pd.DataFrame | None = None) -> tuple[str, list[str]]:
    """The x-axis among the ``swept`` keys (a numeric one when there is one, else the first;
    ``run_id`` when nothing is swept) and the series: the other swept keys, those that tell
    ``runs`` apart (all of them without ``runs``). ``engine`` is never an axis: it tells runs
    from bounds. Keys that vary together (a linked grid dimension) make one series: the first
    of them."""
    swept = [k for k in swept if k != "engine"]
    x = next((k for k in _X_PREFERENCE if k in swept), swept[0] if swept else "run_id")
    if runs is None:
        return x, [k for k in swept if k != x]
    runs = runs.astype(str)
    series: list[str] = []
    for key in swept:
        if key == x or key not in runs:
            continue
        before = runs.groupby(series).ngroups if series else 1
        if runs.groupby([*series, key]).ngroups > before:
            series.append(key)
    return x, series
