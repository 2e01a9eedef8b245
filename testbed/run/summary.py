"""A run's ``metrics.parquet`` and ``summary.json``, from what the run recorded.

Telemetry is the record: per-request hits, failed loads and miss causes come from
``testbed.analysis.attribution`` (the connector's spans and the server's chunk log), bytes,
failures and outages from the run's own spans (``testbed.analysis.metrics``), so the figures
are the same for every engine and stay the run's own when several runs share one server. The
engine adds only what it alone knows: arrival and first-token times, generated tokens, its
integrity check and its step times. Every field is defined in METRICS.md. What the run could
not record (spans or chunk events a full disk dropped, a chunk Parquet file it could not
write) is listed in ``missing``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from testbed.analysis import metrics
from testbed.analysis.attribution import (
    CATEGORIES,
    EXTERNAL_BY_SOURCE,
    attribution,
    token_causes,
)
from testbed.analysis.chunklog import has_chunk_log, write_chunk_parquet
from testbed.analysis.fleet import routed_summary
from testbed.analysis.tables import Run
from testbed.core.quiescence import QUIESCENCE_KEYS, RUN_QUIESCENCE_KEYS
from testbed.core.run_dir import RunDir
from testbed.core.telemetry import attributes as a
from testbed.core.telemetry.sampling import describe, records_every_trace
from testbed.engine.results import EngineResult
from testbed.run.registry import ENGINES
from testbed.spec.runspec import RunSpec

_ROUND_TRIP_PARTS = (
    ("server", a.SERVER_MS),
    ("request_transit", a.REQUEST_TRANSIT_MS),
    ("handler", a.HANDLER_MS),
    ("reply_read", a.REPLY_READ_MS),
    ("poll_wait", a.POLL_WAIT_MS),
)
_TIMING_PARTS = {
    "lookup": _ROUND_TRIP_PARTS,
    "store": (*_ROUND_TRIP_PARTS, ("copy", a.COPY_MS)),
    "retrieve": (*_ROUND_TRIP_PARTS, ("copy", a.COPY_MS)),
}
"""Per operation, the parts of its connector spans' time the summary reports (p50)."""


def request_table(spec: RunSpec, result: EngineResult, run: Run) -> pd.DataFrame:
    """One row per served request: the attribution joined with the engine's own facts of it
    (or the table of an engine without telemetry, its entry's ``request_table``)."""
    own_table = ENGINES[spec.engine].request_table
    if own_table is not None:
        return own_table(spec, result)
    engine = pd.DataFrame([record.row() for record in result.records])
    attr = attribution(run)
    if engine.empty:
        return attr
    own = engine.drop(columns=["prompt_tokens", "group"]).rename(
        columns={"request_id": "workload_request_id"}
    )
    key = "workload_request_id" if attr["workload_request_id"].notna().any() else "request_id"
    if key == "request_id":
        own = own.rename(columns={"workload_request_id": "request_id"})
    return attr.merge(own, on=key, how="left")


def build_summary(
    spec: RunSpec,
    result: EngineResult,
    run_dir: Path,
    wall_s: float,
    server_after: dict[str, Any] | None,
    bytes_per_token: int,
) -> dict[str, Any]:
    """Writes ``metrics.parquet`` (and ``chunks.parquet``) and returns the summary."""
    missing: list[str] = []
    chunk_log = has_chunk_log(run_dir)
    chunk_rows, chunk_bytes = _write_chunk_table(run_dir, chunk_log, missing)
    run = Run(run_dir)
    requests = request_table(spec, result, run)
    requests.to_parquet(RunDir(run_dir).metrics, index=False)
    summary = _request_figures(spec, result, requests, missing)
    if ENGINES[spec.engine].request_table is not None:
        return summary  # no telemetry: nothing more to count
    spans = run.spans
    summary.update(routed_summary(requests, spans))
    summary["integrity_errors"] = None if result.metadata_only else result.integrity_errors
    summary["chunk_log_rows"] = chunk_rows
    summary["chunk_log_bytes"] = chunk_bytes
    summary["causes_resolved"] = (
        bool(requests["causes_resolved"].all()) if "causes_resolved" in requests else None
    )
    summary.update(_traffic(run, summary["prompt_tokens"], bytes_per_token))
    summary.update(_server_state(server_after))
    summary["chunk_events_dropped"] = _chunk_events_dropped(server_after, chunk_log)
    summary["server_tier_lookups"] = tier_lookups(server_after)
    if summary["chunk_events_dropped"]:
        missing.append(
            f"{summary['chunk_events_dropped']} chunk log events not written by the server "
            "(its disk was full): miss causes they decide count as cold, unresolved"
        )
    summary.update(_engine_times(result, requests, wall_s, summary["prompt_tokens"]))
    summary.update(_operation_times(spans))
    summary.update(mirror_figures(spans, spec.lookup_mirror))
    return summary


def mirror_figures(spans: pd.DataFrame, mirror: bool) -> dict[str, int | None]:
    """What the connector's lookup mirror did, from the servers' lookup spans: the lookups it
    answered itself, those it answered wrong (the server held more: tokens the engine
    recomputed), and the lookups it sent predicting more than was held (``None``: no mirror)."""
    keys = ("mirror_answers", "mirror_wrong", "mirror_wrong_tokens", "mirror_overestimates")
    if not mirror:
        return dict.fromkeys(keys, None)
    lookups = spans[spans["name"] == a.SERVER_LOOKUP]
    if a.MIRROR_HIT_CHUNKS not in lookups:
        return dict.fromkeys(keys, 0)
    lookups = lookups[lookups[a.MIRROR_HIT_CHUNKS].notna()]
    predicted = pd.to_numeric(lookups[a.MIRROR_HIT_CHUNKS]).astype(int)
    hit = pd.to_numeric(lookups[a.CHUNKS_HIT]).fillna(0).astype(int)
    answered = lookups[a.MIRROR_ANSWERED].fillna(False).astype(bool)
    wrong = pd.to_numeric(lookups[a.MIRROR_WRONG_TOKENS]).fillna(0).astype(int)
    return {
        "mirror_answers": int(answered.sum()),
        "mirror_wrong": int((wrong > 0).sum()),
        "mirror_wrong_tokens": int(wrong.sum()),
        "mirror_overestimates": int((~answered & (predicted > hit)).sum()),
    }


def _write_chunk_table(
    run_dir: Path, chunk_log: bool, missing: list[str]
) -> tuple[int | None, int | None]:
    """Writes ``chunks.parquet`` from the run's chunk log: its rows and bytes (``None``
    without a chunk log, or when the disk is full: the raw streams stay and are read instead,
    and ``missing`` says so)."""
    if not chunk_log:
        return None, None
    try:
        return write_chunk_parquet(run_dir)
    except OSError as exc:
        missing.append(f"chunks.parquet not written ({exc}); the raw chunk log stays")
        return None, None


def _request_figures(
    spec: RunSpec, result: EngineResult, requests: pd.DataFrame, missing: list[str]
) -> dict[str, Any]:
    """The run, its requests (served, rejected, recorded) and their tokens by category."""
    served = len(result.records) if result.records else len(requests)
    summary: dict[str, Any] = {
        "run_id": spec.run_id,
        "engine": spec.engine,
        "metadata_only": result.metadata_only,
        "requests": served,
        "requests_rejected": len(result.rejected),
        "requests_recorded": len(requests),
        "sampling": sampling_summary(spec, served, len(requests)),
        "prompt_tokens": int(requests["prompt_tokens"].sum()) if len(requests) else 0,
        "output_tokens": int(requests["output_tokens"].fillna(0).sum()) if len(requests) else 0,
    }
    summary.update(_token_figures(requests))
    summary["missing"] = missing
    summary["requests_served"] = len(result.records)
    if len(result.records) > len(requests):
        missing.append(
            f"{len(result.records) - len(requests)} of the {len(result.records)} requests the "
            "engine served have no telemetry (their spans were not written): the summary's "
            "figures leave them out"
        )
    return summary


def _traffic(run: Run, prompt_tokens: int, bytes_per_token: int) -> dict[str, Any]:
    """Bytes the cache moved and the failures and outages the run's spans recorded;
    ``bytes_per_token``: the engine's, unless its registration recorded its own."""
    totals = metrics.run_totals(run.spans, run.events)
    registered = metrics.registered_bytes_per_token(run.spans)
    bytes_per_token = registered if registered is not None else bytes_per_token
    stored = totals["stored_bytes"]
    return {
        "bytes_per_token": bytes_per_token,
        **totals,
        "store_amplification": stored / (prompt_tokens * bytes_per_token)
        if prompt_tokens and bytes_per_token and stored is not None
        else None,
        "server_outage_s": metrics.server_outage_s(run.spans),
    }


def _engine_times(
    result: EngineResult, requests: pd.DataFrame, wall_s: float, prompt_tokens: int
) -> dict[str, Any]:
    """The engine's steps, wall and projected times, throughput and TTFT quantiles."""
    ttft = requests["ttft_ms"].dropna() if "ttft_ms" in requests else pd.Series(dtype=float)
    return {
        "steps": result.steps,
        "max_step_stall_s": result.max_step_s,
        "engine_wall_s": result.wall_s,
        "run_wall_s": wall_s,
        "projected_s": result.virtual_s,
        "requests_per_s": len(result.records) / result.wall_s if result.wall_s else None,
        "prompt_tokens_per_s": prompt_tokens / result.wall_s if result.wall_s else None,
        "ttft_p50_ms": float(ttft.quantile(0.5)) if len(ttft) else None,
        "ttft_p99_ms": float(ttft.quantile(0.99)) if len(ttft) else None,
        "ttft_count": len(ttft),
    }


def _operation_times(spans: pd.DataFrame) -> dict[str, Any]:
    """Per cache operation (connector side): its count, latency quantiles, the p50 of each
    part of its time, and the time steps waited for stores."""
    summary: dict[str, Any] = {}
    for operation in ("lookup", "store", "retrieve"):
        summary[f"{operation}_count"] = int((spans["name"] == metrics.OPERATIONS[operation]).sum())
        for quantile, label in ((0.5, "p50"), (0.99, "p99")):
            summary[f"{operation}_{label}_ms"] = metrics.operation_latency_ms(
                spans, operation, quantile
            )
    for operation, parts in _TIMING_PARTS.items():
        for part, attribute in parts:
            summary[f"{operation}_{part}_p50_ms"] = metrics.operation_part_ms(
                spans, operation, attribute, 0.5
            )
    stores = spans[spans["name"] == a.CONNECTOR_STORE]
    summary["store_step_wait_ms"] = (
        float(pd.to_numeric(stores[a.STEP_WAIT_MS], errors="coerce").fillna(0).sum())
        if a.STEP_WAIT_MS in stores
        else 0.0
    )
    return summary


def sampling_summary(spec: RunSpec, served: int, recorded: int) -> dict[str, Any]:
    """Which traces the run recorded, and what that makes of its token figures: with every
    trace, the figures are exact; sampled, they cover the ``recorded`` requests only (an
    estimate: ``scale`` = served / recorded takes a total to the whole run)."""
    every = records_every_trace(spec.trace_sampler, spec.trace_sampler_ratio)
    return {
        "sampler": spec.trace_sampler,
        "ratio": spec.trace_sampler_ratio,
        "every_trace": every,
        "estimate": not every,
        "scale": None if every or not recorded else served / recorded,
        "text": describe(spec.trace_sampler, spec.trace_sampler_ratio),
    }


def _token_figures(requests: pd.DataFrame) -> dict[str, Any]:
    if not len(requests):
        return {"tokens": {name: 0 for name in (*CATEGORIES, *EXTERNAL_BY_SOURCE)}}
    causes = token_causes(requests)
    return {
        "engine_hit_tokens": int(requests["engine_hit_tokens"].sum()),
        "external_hit_tokens": int(requests["external_hit_tokens"].sum()),
        "recomputed_tokens": int(requests["recomputed_tokens"].sum()),
        "load_failed_tokens": int(requests["load_failed_tokens"].sum()),
        "token_hit_rate": metrics.token_hit_rate(requests),
        "external_token_hit_rate": metrics.external_token_hit_rate(requests),
        "mean_request_hit_rate": metrics.mean_request_hit_rate(requests),
        "tokens": {name: int(causes[name]) for name in (*CATEGORIES, *EXTERNAL_BY_SOURCE)},
    }


def _server_state(server_after: dict[str, Any] | None) -> dict[str, Any]:
    """The server's state after the run (the quiescence invariant); ``None`` values when it
    could not be asked (it died or hung)."""
    if server_after is None:
        return {
            "server_available_after": False,
            "server_quiescent": None,
            "server_state_after": None,
            "server_state_scope": None,
            "server_locks_after": None,
            "server_tiers": None,
            "server_peers": None,
        }
    own = server_after.get("held")
    source, keys = (
        (own, RUN_QUIESCENCE_KEYS) if own is not None else (server_after, QUIESCENCE_KEYS)
    )
    held = {key: int(source[key]) for key in keys}
    return {
        "server_available_after": True,
        "server_quiescent": not any(held.values()),
        "server_state_after": held,
        "server_state_scope": "run" if own is not None else "server",
        "server_locks_after": held["num_locks"],
        "server_index_bytes": int(server_after["index_bytes"]),
        "server_tiers": _tier_counts(server_after.get("tiers") or {}),
        "server_peers": server_after.get("peers"),
    }


def tier_lookups(server_after: dict[str, Any] | None) -> dict[str, int] | None:
    """The lookups' losses between tiers (server counters since its start): chunks whose
    prefetch was late (``prefetch_timeouts``) or whose read below L1 failed
    (``tier_read_failures``); ``None`` without tiers or without the server's answer."""
    if server_after is None or not server_after.get("tiers"):
        return None
    return {
        "prefetch_timeouts": int(server_after.get("prefetch_timeouts", 0)),
        "tier_read_failures": int(server_after.get("tier_read_failures", 0)),
    }


def _tier_counts(tiers: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The server's counts per tier below L1 as one flat table, ``<tier>_<count>``
    (``L2_reads``; failures by cause as ``L2_failures_<cause>``), so every count is a column."""
    flat: dict[str, Any] = {}
    for name, counts in tiers.items():
        for key, value in counts.items():
            if isinstance(value, dict):
                flat.update(
                    {f"{name}_{key.removesuffix('_by_cause')}_{k}": v for k, v in value.items()}
                )
            else:
                flat[f"{name}_{key}"] = value
    return flat


def _chunk_events_dropped(server_after: dict[str, Any] | None, chunk_log: bool) -> int | None:
    """Chunk log rows the run's own server could not write (``None``: no chunk log here, or
    the server could not be asked)."""
    if server_after is None or not chunk_log:
        return None
    return int(server_after.get("chunk_events_dropped", 0))
