"""The metrics of METRICS.md, each defined once, computed from tidy DataFrames.

Per-request metrics take the per-request table (:attr:`testbed.analysis.tables.Run.requests`,
a run's ``metrics.parquet``; columns ``prompt_tokens``, ``engine_hit_tokens``,
``external_hit_tokens``, ``recomputed_tokens``). Span metrics take a :func:`load_spans` frame.
"""

from __future__ import annotations

import typing
from collections.abc import Sequence

import numpy as np
import pandas as pd

from testbed.core.protocol import LIMIT_CODES, ErrorCode
from testbed.core.telemetry import attributes as a

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


def operation_part_ms(
    spans: pd.DataFrame, operation: str, attribute: str, quantile: float
) -> float | None:
    """A percentile of one timing attribute (``kvcache.server_ms``, ``kvcache.poll_wait_ms``,
    ``kvcache.copy_ms``, ``kvcache.step_wait_ms``) over an operation's connector spans."""
    selected = spans[spans["name"] == OPERATIONS[operation]]
    if attribute not in selected:
        return None
    values = pd.to_numeric(selected[attribute], errors="coerce").dropna()
    return float(np.quantile(values, quantile)) if len(values) else None


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
    if not retrieves.empty and a.SESSION_IDS in begins:
        # A retrieve end carries no session ids; its begin (same parent span) does.
        sessions_by_parent = begins.set_index("parent_span_id")[a.SESSION_IDS].to_dict()
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


# ---------------------------------------------------------------------------------------------
# Per-run truth from spans: what this run stored, retrieved, evicted and failed. Connector
# spans are the run's own; a server span counts for the run whose connector span caused it
# (same trace), so runs sharing one cache server each count their own operations.
# ---------------------------------------------------------------------------------------------

_SERVER_PREFIX = "kvcache.server."
_CONNECTOR_PREFIX = "kvcache.connector."
ERROR_CODES = frozenset(typing.get_args(ErrorCode))


def run_spans(spans: pd.DataFrame, run_id: str | None = None) -> pd.DataFrame:
    """The spans of one run: its own (``run_id`` column; all when ``run_id`` is None) and the
    server spans in the traces they started."""
    if run_id is None or spans.empty:
        return spans
    server = spans["name"].str.startswith(_SERVER_PREFIX)
    own = ~server & (spans["run_id"].astype(str) == run_id)
    traces = set(spans.loc[own, "trace_id"])
    return spans[own | (server & spans["trace_id"].isin(traces))]


def run_stored_bytes(spans: pd.DataFrame, events: pd.DataFrame, run_id: str | None = None) -> int:
    """Bytes this run's stores committed: Σ ``kvcache.bytes`` of the connector store items
    (0 for an item whose commit failed); without items, of the store spans that succeeded."""
    stores = _connector(spans, a.CONNECTOR_STORE, run_id)
    items = _items(events, stores)
    if a.BYTES in items and items[a.BYTES].notna().any():
        return int(pd.to_numeric(items[a.BYTES]).fillna(0).sum())
    ok = column(stores, a.OK, False).astype(bool)
    return int(pd.to_numeric(column(stores[ok], a.BYTES)).sum())


def run_retrieved_bytes(spans: pd.DataFrame, run_id: str | None = None) -> int:
    """Bytes this run's retrieves copied out of the cache: Σ ``kvcache.bytes`` of its
    connector retrieve spans (the connector writes 0 for a retrieve the server did not
    confirm)."""
    retrieves = _connector(spans, a.CONNECTOR_RETRIEVE, run_id)
    return int(pd.to_numeric(column(retrieves, a.BYTES)).sum())


def run_evictions(spans: pd.DataFrame, run_id: str | None = None) -> tuple[int, int] | None:
    """(objects, bytes) evicted for room by this run's stores: server evict spans with reason
    ``capacity`` in the run's traces. ``None`` when the run holds no server spans (an external
    server that wrote its spans elsewhere)."""
    spans = run_spans(spans, run_id)
    if not _has_server_spans(spans):
        return None
    evict = spans[
        (spans["name"] == a.SERVER_EVICT) & (column(spans, a.EVICT_REASON, "") == "capacity")
    ]
    return (
        int(pd.to_numeric(column(evict, a.EVICTED_OBJECTS)).sum()),
        int(pd.to_numeric(column(evict, a.EVICTED_BYTES)).sum()),
    )


def run_server_errors(spans: pd.DataFrame, run_id: str | None = None) -> int | None:
    """Server spans with an error status in the run's traces (``None`` without server spans)."""
    spans = run_spans(spans, run_id)
    if not _has_server_spans(spans):
        return None
    server = spans[spans["name"].str.startswith(_SERVER_PREFIX)]
    return int((server["status"] == "ERROR").sum())


def run_error_replies(spans: pd.DataFrame, run_id: str | None = None) -> int:
    """This run's connector spans that received an error reply: their error (``kvcache.error``,
    else the status message) is ``"<code>: <message>"`` with a protocol error code."""
    return int(_reply_error_codes(spans, run_id).isin(ERROR_CODES).sum())


def run_limit_refusals(spans: pd.DataFrame, run_id: str | None = None) -> int:
    """This run's connector spans whose error reply was a refusal for a server limit or a
    client quota (codes ``LIMIT_CODES``): the server was up and declined."""
    return int(_reply_error_codes(spans, run_id).isin(list(LIMIT_CODES)).sum())


def _reply_error_codes(spans: pd.DataFrame, run_id: str | None) -> pd.Series:
    """The protocol error code of each of the run's connector spans (``""``: none)."""
    connector = _connector(spans, None, run_id)
    if connector.empty:
        return pd.Series([], dtype=object)
    errors = column(connector, a.ERROR, "").astype(str)
    errors = errors.where(errors != "", connector["status_message"].fillna("").astype(str))
    codes = errors.str.partition(": ")[0]
    return codes.where(errors.str.contains(": ", regex=False), "")


def run_transfer_failures(
    spans: pd.DataFrame, events: pd.DataFrame, name: str, run_id: str | None = None
) -> int:
    """Items of this run's connector ``name`` spans (store or retrieve) with ``kvcache.ok``
    false: requests whose store did not commit, or whose load failed on a rank."""
    items = _items(events, _connector(spans, name, run_id))
    return int((pd.to_numeric(column(items, a.OK, True)) == 0).sum())


def run_abandoned_releases(spans: pd.DataFrame, run_id: str | None = None) -> int:
    """Releases this run's connector sent for operations it gave up on: lock releases of
    lookups answered too late (``kvcache.abandoned``) and aborts of stores and retrieves."""
    releases = _connector(spans, a.CONNECTOR_LOCK_RELEASE, run_id)
    abandoned = column(releases, a.ABANDONED, False).astype(bool).sum()
    return int(abandoned) + len(_connector(spans, a.CONNECTOR_ABORT, run_id))


def connector_operation_totals(spans: pd.DataFrame, run_id: str | None = None) -> dict[str, float]:
    """What the connector's metrics on vLLM's ``/metrics`` (``vllm:kvtb_*``) must add up to,
    from the run's own spans (METRICS.md, "vLLM's /metrics"): per operation the spans, those
    not ``kvcache.ok``, their seconds; tokens asked and hit; bytes; abandoned releases."""
    lookups = _connector(spans, a.CONNECTOR_LOOKUP, run_id)
    totals: dict[str, float] = {
        "lookup_requested_tokens": float(pd.to_numeric(column(lookups, a.TOKENS_REQUESTED)).sum()),
        "lookup_hit_tokens": float(pd.to_numeric(column(lookups, a.TOKENS_HIT)).sum()),
        "stored_bytes": float(
            pd.to_numeric(column(_connector(spans, a.CONNECTOR_STORE, run_id), a.BYTES)).sum()
        ),
        "retrieved_bytes": float(run_retrieved_bytes(spans, run_id)),
        "abandoned_releases": float(run_abandoned_releases(spans, run_id)),
    }
    for operation in ("lookup", "store", "retrieve"):
        selected = _connector(spans, OPERATIONS[operation], run_id)
        ok = column(selected, a.OK, True).astype(bool)
        totals[f"{operation}s"] = float(len(selected))
        totals[f"{operation}_failures"] = float((~ok).sum())
        totals[f"{operation}_seconds"] = (
            float(selected["duration_ms"].sum() / 1e3) if len(selected) else 0.0
        )
    return totals


def run_totals(
    spans: pd.DataFrame, events: pd.DataFrame, run_id: str | None = None
) -> dict[str, int | None]:
    """Every per-run figure above, under its summary.json name (METRICS.md, Bytes)."""
    evicted = run_evictions(spans, run_id)
    return {
        "stored_bytes": run_stored_bytes(spans, events, run_id),
        "retrieved_bytes": run_retrieved_bytes(spans, run_id),
        "evicted_objects": None if evicted is None else evicted[0],
        "evicted_bytes": None if evicted is None else evicted[1],
        "server_errors": run_server_errors(spans, run_id),
        "error_replies": run_error_replies(spans, run_id),
        "limit_refusals": run_limit_refusals(spans, run_id),
        "store_failures": run_transfer_failures(spans, events, a.CONNECTOR_STORE, run_id),
        "retrieve_failures": run_transfer_failures(spans, events, a.CONNECTOR_RETRIEVE, run_id),
        "abandoned_releases": run_abandoned_releases(spans, run_id),
    }


def _connector(spans: pd.DataFrame, name: str | None, run_id: str | None) -> pd.DataFrame:
    if spans.empty:
        return spans
    selected = (
        spans["name"].str.startswith(_CONNECTOR_PREFIX) if name is None else spans["name"] == name
    )
    if run_id is not None:
        selected &= spans["run_id"].astype(str) == run_id
    return spans[selected]


def _items(events: pd.DataFrame, spans: pd.DataFrame) -> pd.DataFrame:
    """The ``kvcache.item`` events of ``spans``."""
    if events.empty or spans.empty:
        return events.iloc[0:0]
    return events[(events["event"] == a.ITEM_EVENT) & events["span_id"].isin(set(spans["span_id"]))]


def _has_server_spans(spans: pd.DataFrame) -> bool:
    return bool(len(spans)) and bool(spans["name"].str.startswith(_SERVER_PREFIX).any())


def server_outage_s(spans: pd.DataFrame) -> float:
    """Seconds the cache server did not answer the run: the union of the intervals of its
    ``kvcache.connector.outage`` spans (from a client's first timeout to the server's next
    answer; every process of the run records its own, overlapping ones count once)."""
    outages = spans[spans["name"] == a.CONNECTOR_OUTAGE].sort_values("start_time")
    total = 0.0
    current_end = None
    current_start = None
    for start, end in zip(outages["start_time"], outages["end_time"], strict=True):
        if current_end is None or start > current_end:
            if current_end is not None:
                total += (current_end - current_start).total_seconds()
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        total += (current_end - current_start).total_seconds()
    return total


def registered_bytes_per_token(spans: pd.DataFrame) -> int | None:
    """KV bytes the cache stores per token, as the workers registered them: the sum over KV
    ranks of each rank's bytes per token (one latent rank with MLA). ``None`` without any
    ``kvcache.connector.register`` span."""
    register = spans[spans["name"] == a.CONNECTOR_REGISTER]
    if register.empty or a.BYTES_PER_TOKEN not in register:
        return None
    per_rank = register.dropna(subset=[a.BYTES_PER_TOKEN]).groupby(a.KV_RANK)[a.BYTES_PER_TOKEN]
    return int(per_rank.first().sum()) if len(per_rank) else None
