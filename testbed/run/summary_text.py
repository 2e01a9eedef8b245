"""A run's summary as the lines ``kvtb run`` prints: what was served and rejected, where the
prompt tokens went, what the cache moved and how long it took, whether every trace was recorded,
and why the run failed if it did (METRICS.md defines every figure)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from testbed.core.sizes import format_bytes


def summary_lines(summary: Mapping[str, Any], run_dir: Path) -> list[str]:
    """The printed summary; a figure the run does not have is left out."""
    rows = [
        ("requests", _requests(summary)),
        ("traces", _sampling(summary)),
        ("prompt tokens", summary.get("prompt_tokens")),
        ("token hit rate", _pct(summary.get("token_hit_rate"))),
        ("  engine prefix hits", summary.get("engine_hit_tokens")),
        ("  external hits", summary.get("external_hit_tokens")),
        ("  recomputed", summary.get("recomputed_tokens")),
        ("mean request hit rate", _pct(summary.get("mean_request_hit_rate"))),
        ("stored / retrieved / evicted", _bytes3(summary)),
        ("lookup p50 / p99 ms", _pair(summary, "lookup")),
        ("store p50 / p99 ms", _pair(summary, "store")),
        ("retrieve p50 / p99 ms", _pair(summary, "retrieve")),
        ("lookup mirror answered / wrong", _mirror(summary)),
        ("integrity errors", summary.get("integrity_errors")),
        ("limit refusals", summary.get("limit_refusals") or None),
        ("cache pool", summary.get("pool_medium")),
        (
            "spans exported / dropped",
            f"{summary.get('spans_exported')} / {summary.get('spans_dropped')}",
        ),
    ]
    width = max(len(label) for label, _ in rows)
    lines = [f"run {summary['run_id']} ({summary['engine']}) → {run_dir}"]
    lines += [f"  {label:<{width}}  {value}" for label, value in rows if value is not None]
    lines += [f"  missing: {line}" for line in summary.get("missing") or []]
    lines += [f"  FAILED: {failure}" for failure in summary.get("failures") or []]
    return lines


def _requests(summary: Mapping[str, Any]) -> str:
    served, rejected = summary.get("requests"), summary.get("requests_rejected") or 0
    text = f"{served} served, {rejected} rejected"
    if rejected:
        text += " (too long for vLLM's KV pool: raise engine_blocks)"
    return text


def _sampling(summary: Mapping[str, Any]) -> str | None:
    sampling = summary.get("sampling")
    if not sampling:
        return None
    if sampling.get("every_trace"):
        return str(sampling["text"])
    recorded, served = summary.get("requests_recorded"), summary.get("requests")
    scale = sampling.get("scale")
    estimate = f"; ×{scale:.2f} for the whole run" if scale else ""
    return (
        f"{sampling['text']}: the token figures below are an estimate from the {recorded} of "
        f"{served} requests recorded{estimate}"
    )


def _mirror(summary: Mapping[str, Any]) -> str | None:
    """The lookups the mirror answered itself, and of those the wrong ones (``None``: off)."""
    answers = summary.get("mirror_answers")
    if answers is None:
        return None
    wrong, tokens = summary.get("mirror_wrong"), summary.get("mirror_wrong_tokens")
    return f"{answers} / {wrong} ({tokens} tokens recomputed that the server held)"


def _pct(value: float | None) -> str | None:
    return None if value is None else f"{value:.2%}"


def _pair(summary: Mapping[str, Any], op: str) -> str | None:
    p50, p99 = summary.get(f"{op}_p50_ms"), summary.get(f"{op}_p99_ms")
    return None if p50 is None or p99 is None else f"{p50:.3f} / {p99:.3f}"


def _bytes3(summary: Mapping[str, Any]) -> str | None:
    """Stored, retrieved and evicted bytes; ``?`` for a figure the run could not know (an
    external server's evictions are in its own spans)."""
    if "stored_bytes" not in summary:
        return None
    return " / ".join(
        "?" if summary.get(key) is None else format_bytes(summary[key])
        for key in ("stored_bytes", "retrieved_bytes", "evicted_bytes")
    )
