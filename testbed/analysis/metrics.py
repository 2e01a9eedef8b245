"""The metrics of METRICS.md, each defined once, computed from tidy DataFrames.

Per-request metrics take a *requests* frame (columns ``prompt_tokens``, ``engine_hit_tokens``,
``external_hit_tokens``, ``recomputed_tokens``; from a run's ``metrics.parquet`` or from
:func:`testbed.analysis.tables.requests_table`). Span metrics take a :func:`load_spans` frame.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from testbed.telemetry import attributes as a

OPERATIONS = {
    "lookup": a.CONNECTOR_LOOKUP,
    "store": a.CONNECTOR_STORE,
    "retrieve": a.CONNECTOR_RETRIEVE,
    "lock_release": a.CONNECTOR_LOCK_RELEASE,
    "end_session": a.CONNECTOR_END_SESSION,
}


def token_hit_rate(requests: pd.DataFrame) -> float:
    """(engine prefix hits + external hits) / prompt tokens, over all requests."""
    prompt = requests["prompt_tokens"].sum()
    hits = requests["engine_hit_tokens"].sum() + requests["external_hit_tokens"].sum()
    return float(hits / prompt) if prompt else 0.0


def external_token_hit_rate(requests: pd.DataFrame) -> float:
    """External (cache server) hits / prompt tokens."""
    prompt = requests["prompt_tokens"].sum()
    return float(requests["external_hit_tokens"].sum() / prompt) if prompt else 0.0


def mean_request_hit_rate(requests: pd.DataFrame) -> float:
    """Mean over requests of (engine + external hits) / prompt tokens."""
    if requests.empty:
        return 0.0
    rates = (requests["engine_hit_tokens"] + requests["external_hit_tokens"]) / requests[
        "prompt_tokens"
    ]
    return float(rates.mean())


def token_breakdown(requests: pd.DataFrame) -> pd.Series:
    """Prompt tokens by source: engine prefix cache, external cache, recomputed."""
    return pd.Series(
        {
            "engine": int(requests["engine_hit_tokens"].sum()),
            "external": int(requests["external_hit_tokens"].sum()),
            "recomputed": int(requests["recomputed_tokens"].sum()),
        }
    )


def latency_percentiles(
    spans: pd.DataFrame,
    names: Sequence[str] | None = None,
    quantiles: Sequence[float] = (0.5, 0.9, 0.99),
) -> pd.DataFrame:
    """Duration percentiles (ms) per span name: one row per name, columns ``count``, ``p50``..."""
    selected = spans if names is None else spans[spans["name"].isin(list(names))]
    if selected.empty:
        return pd.DataFrame(columns=["count", *(f"p{round(q * 100)}" for q in quantiles)])
    grouped = selected.groupby("name")["duration_ms"]
    table = grouped.quantile(list(quantiles)).unstack()
    table.columns = [f"p{round(q * 100)}" for q in quantiles]
    table.insert(0, "count", grouped.size())
    return table


def operation_latency_ms(spans: pd.DataFrame, operation: str, quantile: float) -> float | None:
    """A percentile of a connector-side operation's duration (the engine's view, in ms)."""
    durations = spans.loc[spans["name"] == OPERATIONS[operation], "duration_ms"]
    return float(np.quantile(durations, quantile)) if len(durations) else None


def evictions(spans: pd.DataFrame) -> pd.DataFrame:
    """One row per eviction span: time, reason, objects and bytes."""
    evict = spans[spans["name"] == a.SERVER_EVICT]
    columns = {
        "start_time": "time",
        a.EVICT_REASON: "reason",
        a.EVICTED_OBJECTS: "objects",
        a.EVICTED_BYTES: "bytes",
    }
    return evict.reindex(columns=list(columns)).rename(columns=columns).reset_index(drop=True)


def stored_bytes(spans: pd.DataFrame) -> int:
    """Bytes committed to the cache (server-side store spans of committed stores)."""
    commits = spans[(spans["name"] == a.SERVER_STORE) & (column(spans, a.OP) == "store_commit")]
    if commits.empty or a.BYTES not in commits:
        return 0
    return int(commits[a.BYTES].fillna(0).sum())


_HOLD_COLUMNS = ["session_id", "released_by", "hold_ms"]


def lock_hold_times(spans: pd.DataFrame) -> pd.DataFrame:
    """How long each session's read locks were held: lookup (locks taken) → release.

    One row per release: ``session_id``, ``released_by`` (``free``, ``retrieve``, ``ttl``,
    ``client_timeout``) and ``hold_ms``.
    """
    server = spans[spans["name"].str.startswith("kvcache.server.")]
    if server.empty or a.SESSION_ID not in server:
        return pd.DataFrame(columns=_HOLD_COLUMNS)
    lookups = server[(server["name"] == a.SERVER_LOOKUP) & (column(server, a.LOCKS_TAKEN) > 0)]
    taken = lookups.groupby(a.SESSION_ID)["end_time"].min()
    rows = []
    frees = server[
        (server["name"] == a.SERVER_LOCK_RELEASE) & (column(server, a.LOCKS_RELEASED) > 0)
    ]
    rows += [(s, "free", t) for s, t in zip(frees[a.SESSION_ID], frees["end_time"], strict=True)]
    expiries = server[server["name"] == a.SERVER_LOCK_EXPIRE]
    rows += list(
        zip(
            expiries[a.SESSION_ID],
            column(expiries, a.EVICT_REASON, ""),
            expiries["end_time"],
            strict=True,
        )
    )
    retrieves = server[
        (server["name"] == a.SERVER_RETRIEVE) & (column(server, a.OP) == "retrieve_end")
    ]
    begins = server[
        (server["name"] == a.SERVER_RETRIEVE) & (column(server, a.OP) == "retrieve_begin")
    ]
    if not retrieves.empty and a.REQUEST_IDS in begins:
        # A retrieve end carries no session ids; its begin (same parent span) does.
        sessions_by_parent = begins.set_index("parent_span_id")[a.REQUEST_IDS].to_dict()
        for parent, t in zip(retrieves["parent_span_id"], retrieves["end_time"], strict=True):
            for session in sessions_by_parent.get(parent, []) or []:
                rows.append((session, "retrieve", t))
    releases = pd.DataFrame(rows, columns=["session_id", "released_by", "time"])
    releases = releases[releases["session_id"].isin(taken.index)]
    if releases.empty:  # no lookup ever locked anything (e.g. a workload without reuse)
        return pd.DataFrame(columns=_HOLD_COLUMNS)
    releases["hold_ms"] = (
        releases["time"] - releases["session_id"].map(taken)
    ).dt.total_seconds() * 1e3
    return releases.drop(columns="time").reset_index(drop=True)


def column(frame: pd.DataFrame, name: str, default: object = 0) -> pd.Series:
    """A column with missing values (or the whole column, if absent) set to ``default``."""
    if name not in frame:
        return pd.Series(default, index=frame.index)
    return frame[name].fillna(default)
