"""A run's ``summary.json``: the headline numbers, defined in METRICS.md."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from testbed.analysis import metrics
from testbed.analysis.spans import load_spans
from testbed.engine.results import EngineResult
from testbed.runspec import RunSpec


def build_summary(
    spec: RunSpec,
    result: EngineResult,
    requests: pd.DataFrame,
    server_stats: dict[str, int] | None,
    run_dir: Path,
    wall_s: float,
) -> dict[str, Any]:
    summary: dict[str, Any] = {
        "run_id": spec.run_id,
        "engine": spec.engine,
        "metadata_only": result.metadata_only,
        "requests": len(result.records),
        "requests_rejected": len(result.rejected),
        "prompt_tokens": int(requests["prompt_tokens"].sum()) if len(requests) else 0,
        "output_tokens": int(requests["output_tokens"].sum()) if len(requests) else 0,
    }
    if len(requests):
        breakdown = metrics.token_breakdown(requests)
        summary.update(
            {
                "engine_hit_tokens": int(breakdown["engine"]),
                "external_hit_tokens": int(breakdown["external"]),
                "recomputed_tokens": int(breakdown["recomputed"]),
                "load_failed_tokens": int(requests["load_failed_tokens"].sum()),
                "token_hit_rate": metrics.token_hit_rate(requests),
                "external_token_hit_rate": metrics.external_token_hit_rate(requests),
                "mean_request_hit_rate": metrics.mean_request_hit_rate(requests),
                "preemptions": int(requests["preemptions"].sum()),
            }
        )
    if spec.engine == "oracle":
        return summary
    summary["integrity_errors"] = None if result.metadata_only else result.integrity_errors
    if server_stats is not None:
        summary.update(
            {
                "stored_bytes": server_stats["stored_bytes"],
                "retrieved_bytes": server_stats["retrieved_bytes"],
                "evicted_bytes": server_stats["evicted_bytes"],
                "evicted_objects": server_stats["evicted_objects"],
                "store_amplification": (
                    server_stats["stored_bytes"]
                    / (summary["prompt_tokens"] * spec.kv_profile.stored_bytes_per_token(spec.tp))
                    if summary["prompt_tokens"]
                    else None
                ),
                "server_locks_after": server_stats["num_locks"],
                "server_errors": server_stats["errors"],
            }
        )
    ttft = requests["ttft_ms"].dropna() if len(requests) else pd.Series(dtype=float)
    summary.update(
        {
            "steps": result.steps,
            "engine_wall_s": result.wall_s,
            "run_wall_s": wall_s,
            "projected_s": result.virtual_s,
            "requests_per_s": len(result.records) / result.wall_s if result.wall_s else None,
            "prompt_tokens_per_s": summary["prompt_tokens"] / result.wall_s
            if result.wall_s
            else None,
            "ttft_p50_ms": float(ttft.quantile(0.5)) if len(ttft) else None,
            "ttft_p99_ms": float(ttft.quantile(0.99)) if len(ttft) else None,
        }
    )
    spans = load_spans(run_dir)
    for operation in ("lookup", "store", "retrieve"):
        for quantile, label in ((0.5, "p50"), (0.99, "p99")):
            summary[f"{operation}_{label}_ms"] = metrics.operation_latency_ms(
                spans, operation, quantile
            )
    return summary
