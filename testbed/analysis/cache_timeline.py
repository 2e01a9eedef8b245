"""What the cache server did over a run, on the workload's clock: evictions and its fill.

Two clocks. Requests carry the **workload clock**: ``arrival_s`` of the per-request table
(the trace's or generator's arrival time; the replay runs faster or slower than it). Server
spans carry the **run clock**: wall time. :func:`server_timeline` puts server events on the
workload clock too, as the arrival time of the latest request the connector had admitted
when the event happened (its ``kvcache.connector.request`` span had started), so that a
drop in hit rate and the evictions before it line up; ``run_s`` keeps the wall time (seconds
since the run's first span). :func:`testbed.analysis.over_time.evictions_figure` draws it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import pandas as pd

from testbed.analysis import metrics
from testbed.analysis.tables import Run
from testbed.core.telemetry import attributes as a


@dataclass(frozen=True)
class CacheTimeline:
    """What the cache server did over a run: evictions and its fill."""

    evictions: pd.DataFrame
    """One row per ``kvcache.server.evict`` span: ``time`` (UTC), ``run_s``, ``arrival_s``
    (workload clock; NaN without admissions to map it), ``reason``, ``objects``, ``bytes``,
    ``cumulative_bytes`` and ``cumulative_objects`` (per reason, in order)."""
    usage: pd.DataFrame
    """Bytes in use after each server span that reports them (``kvcache.used_bytes``: store
    begin and commit, evictions): ``time``, ``run_s``, ``arrival_s``, ``used_bytes``."""
    capacity_bytes: int | None
    """The server's capacity (from its evict spans or the run's resource); ``None`` when
    unknown or when the run asked for an unlimited cache."""
    clock: str
    """``arrival_s`` when server events could be put on the workload clock, else ``run_s``."""


def cache_timeline(run: Run) -> CacheTimeline:
    """:class:`CacheTimeline` of one run (``run.spans``, ``run.requests``; a run whose spec
    asked for an unlimited cache has no capacity line: its server's pool is only sized to
    fit)."""
    try:
        spec = run.spec
    except FileNotFoundError:
        spec = {}
    unlimited = bool(spec) and spec.get("capacity_tokens") is None
    unlimited &= spec.get("capacity_bytes") is None
    return server_timeline(run.spans, _requests_or_empty(run), unlimited=unlimited)


def server_timeline(
    spans: pd.DataFrame, requests: pd.DataFrame, *, unlimited: bool = False
) -> CacheTimeline:
    """:class:`CacheTimeline` of the server spans in ``spans``, on the workload clock of
    ``requests`` (the per-request table: ``span_id`` of each connector request span and
    ``arrival_s``). The capacity is the evict spans' ``kvcache.capacity_bytes``, else the
    resource's; ``None`` when ``unlimited``."""
    origin = spans["start_time"].min() if len(spans) else pd.NaT
    admitted_at, arrival = _admissions(spans, requests)

    def place(times: pd.Series) -> tuple[np.ndarray, np.ndarray]:
        times = pd.Series(pd.to_datetime(times, utc=True))
        run_s = (times - origin).dt.total_seconds().to_numpy(dtype=float)
        return run_s, _on_workload_clock(times, admitted_at, arrival)

    evict = spans[spans["name"] == a.SERVER_EVICT].sort_values("start_time", kind="stable")
    base = metrics.evictions(evict)
    run_s, arrival_s = place(base["time"])
    evictions = base.assign(
        run_s=run_s,
        arrival_s=arrival_s,
        reason=base["reason"].fillna("capacity").astype(str),
        objects=pd.to_numeric(base["objects"]).fillna(0).astype("int64"),
        bytes=pd.to_numeric(base["bytes"]).fillna(0).astype("int64"),
    )
    by_reason = evictions.groupby("reason", sort=False)
    evictions["cumulative_bytes"] = by_reason["bytes"].cumsum()
    evictions["cumulative_objects"] = by_reason["objects"].cumsum()
    evictions = evictions[
        ["time", "run_s", "arrival_s", "reason", "objects", "bytes"]
        + ["cumulative_bytes", "cumulative_objects"]
    ]
    reported = spans[spans["name"].str.startswith("kvcache.server.")]
    if a.USED_BYTES in reported:
        reported = reported[reported[a.USED_BYTES].notna()].sort_values("end_time", kind="stable")
    else:
        reported = reported.iloc[0:0]
    run_s, arrival_s = place(reported["end_time"])
    usage = pd.DataFrame(
        {
            "time": reported["end_time"].to_numpy(),
            "run_s": run_s,
            "arrival_s": arrival_s,
            "used_bytes": pd.to_numeric(metrics.column(reported, a.USED_BYTES)).to_numpy(),
        }
    )
    clock = "arrival_s" if len(admitted_at) else "run_s"
    capacity = None if unlimited else _capacity(spans, evict)
    return CacheTimeline(evictions, usage, capacity, clock)


def eviction_summary(timelines: Mapping[str, CacheTimeline]) -> pd.DataFrame:
    """Per run and eviction reason: ``evictions`` (evict spans), ``objects`` and ``bytes``;
    a run without evictions has one row with reason ``none`` and zeros."""
    rows = []
    for label, timeline in timelines.items():
        evictions = timeline.evictions
        if evictions.empty:
            rows.append((label, "none", 0, 0, 0))
        for reason, group in evictions.groupby("reason", sort=False):
            rows.append(
                (
                    label,
                    str(reason),
                    len(group),
                    int(group["objects"].sum()),
                    int(group["bytes"].sum()),
                )
            )
    return pd.DataFrame(rows, columns=["run", "reason", "evictions", "objects", "bytes"])


def _requests_or_empty(run: Run) -> pd.DataFrame:
    try:
        return run.requests
    except FileNotFoundError:
        return pd.DataFrame(columns=["span_id", "arrival_s"])


def _admissions(spans: pd.DataFrame, requests: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(admission times in ns, their arrival_s), sorted by admission: the connector request
    span's start of every request with an arrival time."""
    if requests.empty or "arrival_s" not in requests or "span_id" not in requests:
        return np.zeros(0, dtype=np.int64), np.zeros(0)
    starts = spans[spans["name"] == a.CONNECTOR_REQUEST].set_index("span_id")["start_time"]
    starts = starts[~starts.index.duplicated()]
    if starts.empty:
        return np.zeros(0, dtype=np.int64), np.zeros(0)
    admitted = requests["span_id"].map(starts)
    arrival = pd.to_numeric(requests["arrival_s"], errors="coerce")
    known = admitted.notna() & arrival.notna()
    times = pd.DatetimeIndex(pd.to_datetime(admitted[known], utc=True)).as_unit("ns").asi8
    order = np.argsort(times, kind="stable")
    return times[order], arrival[known].to_numpy(dtype=float)[order]


def _on_workload_clock(
    times: pd.Series, admitted_at: np.ndarray, arrival: np.ndarray
) -> np.ndarray:
    """Each time as the arrival of the latest request admitted by then (the first request's
    arrival before any); NaN without admissions."""
    if not len(admitted_at):
        return np.full(len(times), np.nan)
    values = pd.DatetimeIndex(pd.to_datetime(times, utc=True)).as_unit("ns").asi8
    latest = np.maximum(np.searchsorted(admitted_at, values, side="right") - 1, 0)
    # Arrivals of admitted requests need not be monotone (a long request admitted late):
    # the clock is the latest arrival admitted so far.
    return np.maximum.accumulate(arrival)[latest]


def _capacity(spans: pd.DataFrame, evict: pd.DataFrame) -> int | None:
    for frame, column in ((evict, a.CAPACITY_BYTES), (spans, f"resource.{a.CAPACITY_BYTES}")):
        if column in frame:
            values = pd.to_numeric(frame[column], errors="coerce").dropna()
            if len(values):
                return int(values.max())
    return None
