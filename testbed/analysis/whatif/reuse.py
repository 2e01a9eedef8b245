"""Reuse distance and reuse interval distributions, per workload group.

For every chunk a request's first lookup asks for that was referenced before:

- **reuse distance** (bytes): its stack distance x the bytes one chunk stores (``C`` x stored
  bytes per token): the smallest LRU cache that would still hold it;
- **reuse interval** (seconds): time since its last reference (workload: arrivals; run: the
  server's clock).

Chunks seen for the first time (cold) have neither. ``group`` ``"all"`` pools every request;
at most :data:`MAX_GROUPS` groups are reported on their own.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from testbed.analysis.whatif.stack import COLD, StackResult
from testbed.models.access_trace import AccessTrace

ALL = "all"
MAX_GROUPS = 32
"""Groups reported on their own (those with the most reuses); ``"all"`` still pools every one."""
QUANTILES = np.linspace(0.0, 1.0, 101)
"""The quantiles stored per group (the CDF figure is drawn from them)."""
SUMMARY_QUANTILES = (0.5, 0.9, 0.95, 0.99)


def reuse_quantiles(
    trace: AccessTrace, stack: StackResult, stored_bytes_per_token: int
) -> pd.DataFrame:
    """Columns ``chunk_size, group, quantile, reuse_distance_bytes, reuse_interval_s, count``:
    the :data:`QUANTILES` of both distributions per group and for ``"all"``."""
    request = trace.query_request
    reused = (request >= 0) & (stack.distances != COLD)
    chunk_bytes = trace.chunk_size * stored_bytes_per_token
    distances = stack.distances[reused].astype(np.float64) * chunk_bytes
    intervals = stack.intervals_s[reused]
    frames = [_quantiles(trace.chunk_size, ALL, distances, intervals)]
    # Groups as codes, one per request (names in sorted order): a name per reused chunk would
    # take gigabytes on a long trace.
    names, codes = np.unique(trace.groups.astype(str), return_inverse=True)
    group_of = codes[request[reused]]
    counts = np.bincount(group_of, minlength=len(names))
    present = np.flatnonzero((counts > 0) & (names != ""))
    largest = present[np.argsort(-counts[present], kind="stable")[:MAX_GROUPS]]
    for code in sorted(largest.tolist()):  # in name order
        chosen = group_of == code
        name = str(names[code])
        frames.append(_quantiles(trace.chunk_size, name, distances[chosen], intervals[chosen]))
    return pd.concat(frames, ignore_index=True)


def reuse_summary(quantiles: pd.DataFrame) -> list[dict[str, object]]:
    """Per chunk size and group: count, p50/p90/p95/p99 of distance (bytes) and interval (s)."""
    rows = []
    for (chunk_size, group), frame in quantiles.groupby(["chunk_size", "group"], sort=False):
        row: dict[str, object] = {
            "chunk_size": int(chunk_size),
            "group": group,
            "count": int(frame["count"].iloc[0]),
        }
        for q in SUMMARY_QUANTILES:
            at = frame.iloc[int(np.argmin(np.abs(frame["quantile"].to_numpy() - q)))]
            label = f"p{round(q * 100)}"
            row[f"distance_bytes_{label}"] = _finite(at["reuse_distance_bytes"])
            row[f"interval_s_{label}"] = _finite(at["reuse_interval_s"])
        rows.append(row)
    return rows


def _quantiles(
    chunk_size: int, group: str, distances: np.ndarray, intervals: np.ndarray
) -> pd.DataFrame:
    empty = len(distances) == 0
    return pd.DataFrame(
        {
            "chunk_size": chunk_size,
            "group": group,
            "quantile": QUANTILES,
            "reuse_distance_bytes": np.full(len(QUANTILES), np.nan)
            if empty
            else np.quantile(distances, QUANTILES),
            "reuse_interval_s": np.full(len(QUANTILES), np.nan)
            if empty
            else np.quantile(intervals, QUANTILES),
            "count": len(distances),
        }
    )


def _finite(value: float) -> float | None:
    return None if not np.isfinite(value) else float(value)
