"""Where every prompt token went: one row per request, each prompt token in exactly one category.

:func:`attribution` reads a run's telemetry, and nothing else: the connector's request spans
(one per vLLM request: ``P``, ``E``, ``H``, ``L``, lookup status), the attempt-0 retrieve items
of every TP rank (the first failed token of each), and the server's chunk event log
(:mod:`testbed.analysis.chunklog`: each chunk's lookup status, and whether an object of it had
been committed before). METRICS.md defines every category; in short, for a request with prompt
tokens ``P``, chunk size ``C``:

- ``engine`` ``[0, E)``: vLLM's own prefix cache; ``external`` ``[E, E+X)``: loaded from the
  cache server, ``X`` = tokens below the first failed block over all TP ranks;
  ``load_failed`` ``[E+X, E+L)``: promised, not loaded; ``last_token`` ``P-1``;
- ``routing`` (fleets): the tokens of ``[E+L, P-1)`` another instance's prefix cache held at
  the routing decision beyond what the chosen one held (:mod:`testbed.analysis.routing`);
- every other token ``t`` in ``[E+L, P-1)``: ``partial_chunk`` if ``t >= floor(P/C)*C``, else
  ``unavailable`` if the lookup failed, ``refused`` if the server refused it for a limit or a
  client quota, ``engine_only`` if the server held chunk ``t // C`` at
  lookup, else the cause of that chunk's lookup status: ``in_flight``, ``capacity`` (absent,
  but committed before the lookup) or ``cold`` (never committed before); a chunk that hit
  behind an earlier miss takes the cause of the nearest earlier chunk that missed.

Without a chunk log (an external server that wrote its log elsewhere) the chunks a lookup
missed count as ``cold`` and ``causes_resolved`` is False for the requests concerned.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from testbed.analysis.chunk_causes import CHUNK_CAUSES, chunk_causes
from testbed.analysis.routing import overlap, route_table, routing_region
from testbed.analysis.tables import Run
from testbed.core.hit_sources import HIT_SOURCES
from testbed.core.telemetry import attributes as a

CATEGORIES = (
    "engine",
    "external",
    "cold",
    "capacity",
    "partial_chunk",
    "last_token",
    "load_failed",
    "in_flight",
    "unavailable",
    "refused",
    "engine_only",
    "routing",
    "prefetch_timeout",
    "tier_read_failed",
    "store_dropped",
)
"""Every prompt token is in exactly one of these (summary.json's ``tokens`` table)."""
EXTERNAL_BY_SOURCE = tuple(f"external_{source}" for source in HIT_SOURCES)
"""``external`` split by the tier the server matched each token's chunk in at lookup
(``external_host`` ... ``external_p2p``; they sum to ``external``, and are not categories of
their own: summary.json's ``tokens`` table carries them beside the categories)."""
MISS_CAUSES = CATEGORIES[2:]
"""The categories of tokens the engine computed (every category but engine and external)."""
LOOKUP_OK, LOOKUP_UNAVAILABLE, LOOKUP_NONE = "ok", "unavailable", "none"
LOOKUP_REFUSED = "refused"
"""The server answered the lookup with a limit or quota error
(``testbed.core.protocol.LIMIT_CODES``):
up and reachable, it declined to take more for this client."""

COLUMNS = (
    "request_id",
    "workload_request_id",
    "session_id",
    "group",
    "trace_id",
    "span_id",
    "prompt_tokens",
    "engine_hit_tokens",
    "external_hit_tokens",
    "recomputed_tokens",
    "load_failed_tokens",
    "promised_tokens",
    "server_hit_tokens",
    "lookup_status",
    "chunk_size",
    "tp_size",
    *CATEGORIES,
    *EXTERNAL_BY_SOURCE,
    "causes_resolved",
)


def attribution(run: Run | Path | str) -> pd.DataFrame:
    """One row per connector request span of ``run`` (a run directory or a :class:`Run`).

    Columns: ``request_id`` (vLLM's), ``workload_request_id`` and ``group`` (from the parent
    engine span, when there is one), ``session_id``, ``trace_id``, ``span_id``,
    ``prompt_tokens`` P, ``engine_hit_tokens`` E, ``external_hit_tokens`` X,
    ``recomputed_tokens`` R = P - E - X, ``load_failed_tokens`` L - X, ``promised_tokens`` L,
    ``server_hit_tokens`` H (nullable: no successful lookup), ``lookup_status``,
    ``chunk_size``, ``tp_size``, one column per :data:`CATEGORIES` entry (they sum to P) and
    ``causes_resolved``. ``attrs["chunk_log"]`` says whether a chunk log was found;
    ``attrs["clamped_requests"]`` counts requests whose E or L exceeded what the prompt allows
    (``E + L <= P - 1``) and were clamped to it.
    """
    run = as_run(run)
    requests = connector_requests(run.spans)
    return attribute(requests, run.spans, run.events, run.chunks)


def token_causes(attr: pd.DataFrame) -> pd.Series:
    """Sums of every category, and of ``external`` by hit source, over the requests of
    ``attr`` (summary.json's ``tokens``; a table without the split counts it all as host)."""
    sums = {name: int(attr[name].sum()) if len(attr) else 0 for name in CATEGORIES}
    for name in EXTERNAL_BY_SOURCE:
        if name in attr:
            sums[name] = int(attr[name].sum()) if len(attr) else 0
        else:
            sums[name] = sums["external"] if name == "external_host" else 0
    return pd.Series(sums, dtype="int64")


def as_run(run: Run | Path | str) -> Run:
    return run if isinstance(run, Run) else Run(Path(run))


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


def connector_requests(spans: pd.DataFrame) -> pd.DataFrame:
    """The connector request spans as a frame: ids, P, E, H, L, lookup status, geometry, and
    the workload id and group of the parent engine span."""
    rows = spans[spans["name"] == a.CONNECTOR_REQUEST].reset_index(drop=True)
    hit = _numbers(rows, a.TOKENS_HIT)
    status = _strings(rows, a.LOOKUP_STATUS)
    implied = np.where(hit.notna(), LOOKUP_OK, LOOKUP_UNAVAILABLE)
    frame = pd.DataFrame(
        {
            "request_id": _strings(rows, a.REQUEST_ID).to_numpy(),
            "session_id": _strings(rows, a.SESSION_ID).to_numpy(),
            "trace_id": rows["trace_id"].to_numpy(),
            "span_id": rows["span_id"].array,
            "parent_span_id": rows["parent_span_id"].to_numpy(),
            "start_time": rows["start_time"].to_numpy(),
            "prompt_tokens": _ints(rows, a.PROMPT_TOKENS),
            "engine_hit_tokens": _ints(rows, a.ENGINE_HIT_TOKENS),
            "promised_tokens": _ints(rows, a.PROMISED_TOKENS),
            "server_hit_tokens": hit.astype("Int64").to_numpy(),
            **{
                f"hit_{source}_tokens": _numbers(rows, a.TOKENS_HIT_BY_SOURCE[source])
                .fillna(0)
                .to_numpy(dtype=np.int64)
                for source in HIT_SOURCES
            },
            "lookup_status": np.where(status == "", implied, status),
            "chunk_size": _ints(rows, a.CHUNK_SIZE, fallback=f"resource.{a.CHUNK_SIZE}"),
            "tp_size": np.maximum(_ints(rows, a.TP_SIZE, fallback=f"resource.{a.TP_SIZE}"), 1),
        }
    )
    if len(frame) and (frame["chunk_size"] < 1).any():
        raise ValueError(
            f"{a.CONNECTOR_REQUEST} spans without {a.CHUNK_SIZE}: the chunk size is needed"
        )
    engine = spans[spans["name"] == a.REQUEST]
    parents = pd.DataFrame(
        {
            "parent_span_id": engine["span_id"].to_numpy(),
            "workload_request_id": _strings(engine, a.REQUEST_ID).to_numpy(),
            "group": _strings(engine, a.REQUEST_GROUP).replace("", None).to_numpy(),
        }
    ).drop_duplicates("parent_span_id")
    frame = frame.merge(parents, on="parent_span_id", how="left")
    return frame


def retrieve_items(spans: pd.DataFrame, events: pd.DataFrame) -> pd.DataFrame:
    """Attempt-0 retrieve items, one row each: ``request_id``, ``rank`` (TP rank of the worker
    that retrieved), ``failed``, ``first_failed_token`` (the item's first failed token;
    +inf when it loaded everything), ``span_id``."""
    columns = ["request_id", "rank", "failed", "first_failed_token", "span_id"]
    if events.empty or a.REQUEST_ID not in events:
        return pd.DataFrame(columns=columns)
    is_item = (events["span_name"] == a.CONNECTOR_RETRIEVE) & (events["event"] == a.ITEM_EVENT)
    items = events[is_item]
    items = items[_numbers(items, a.REQUEST_ATTEMPT).fillna(0).to_numpy() == 0]
    ranks = spans.drop_duplicates("span_id").set_index("span_id")["rank"]
    first_failed = _numbers(items, a.FIRST_FAILED_TOKEN)
    # An item failed if it says so (kvcache.ok false), or, without kvcache.ok, if it names a
    # first failed token.
    ok = _numbers(items, a.OK).to_numpy()
    failed = np.where(np.isnan(ok), first_failed.notna().to_numpy(), ok == 0)
    # A failed item without a first failed token failed from the first token it was to load.
    to_load = _numbers(items, a.RANGE_START).fillna(0) + _numbers(
        items, a.SKIP_FIRST_N_TOKENS
    ).fillna(0)
    token = np.where(failed, first_failed.fillna(to_load).to_numpy(dtype=float), np.inf)
    return pd.DataFrame(
        {
            "request_id": _strings(items, a.REQUEST_ID).to_numpy(),
            "rank": pd.to_numeric(items["span_id"].map(ranks)).fillna(0).astype("int64").to_numpy(),
            "failed": failed,
            "first_failed_token": token,
            "span_id": items["span_id"].to_numpy(),
        }
    )


# ---------------------------------------------------------------------------------------------
# Accounting
# ---------------------------------------------------------------------------------------------


def attribute(
    requests: pd.DataFrame,
    spans: pd.DataFrame,
    events: pd.DataFrame,
    chunks: pd.DataFrame | None,
) -> pd.DataFrame:
    """:func:`attribution` over given inputs (``requests`` from :func:`connector_requests`)."""
    requests = requests.reset_index(drop=True)
    P = requests["prompt_tokens"].to_numpy(dtype=np.int64)
    C = requests["chunk_size"].to_numpy(dtype=np.int64)
    last = np.maximum(P - 1, 0)
    E, L, clamped = _clamped_hits(requests, last)
    X = loaded_tokens(requests, E, L, retrieve_items(spans, events))
    status = requests["lookup_status"].astype(str).to_numpy()
    H = pd.to_numeric(requests["server_hit_tokens"]).fillna(0).to_numpy(dtype=np.int64)
    workload_ids = requests.get("workload_request_id", pd.Series(None, index=requests.index))
    routing = routing_region(workload_ids, E + L, last, route_table(spans))
    regions = _regions(P, C, E, L, H, status, routing)
    out = _token_columns(requests, P, C, E, L, X, status)
    out["routing"] = routing[1] - routing[0]
    for name in ("partial_chunk", "unavailable", "refused", "engine_only"):
        out[name] = regions[name]
    for name, tokens in external_by_source(requests, E, X, H).items():
        out[name] = tokens
    causes, resolved = chunk_causes(requests, regions, chunks)
    for name in CHUNK_CAUSES:
        out[name] = causes[name]
    out["causes_resolved"] = resolved
    out = out[list(COLUMNS)]
    out.attrs["chunk_log"] = chunks is not None
    out.attrs["clamped_requests"] = clamped
    return out


def _clamped_hits(requests: pd.DataFrame, last: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """``E`` (the engine's hit) within ``[0, last]`` and ``L`` (the tokens promised) within
    ``[0, last - E]``, and how many requests either had to be clamped in."""
    E = np.clip(requests["engine_hit_tokens"].to_numpy(dtype=np.int64), 0, last)
    L = np.clip(requests["promised_tokens"].to_numpy(dtype=np.int64), 0, last - E)
    clamped = int(
        (
            (requests["engine_hit_tokens"].to_numpy() != E)
            | (requests["promised_tokens"].to_numpy() != L)
        ).sum()
    )
    return E, L, clamped


def _token_columns(
    requests: pd.DataFrame,
    P: np.ndarray,
    C: np.ndarray,
    E: np.ndarray,
    L: np.ndarray,
    X: np.ndarray,
    status: np.ndarray,
) -> pd.DataFrame:
    """Per request: its ids, its token counts and the regions ``engine``, ``external``,
    ``last_token`` and ``load_failed`` (the other regions are the caller's)."""
    return pd.DataFrame(
        {
            "request_id": requests["request_id"],
            "workload_request_id": requests.get("workload_request_id"),
            "session_id": requests["session_id"],
            "group": requests.get("group"),
            "trace_id": requests["trace_id"],
            "span_id": requests["span_id"],
            "prompt_tokens": P,
            "engine_hit_tokens": E,
            "external_hit_tokens": X,
            "recomputed_tokens": P - E - X,
            "load_failed_tokens": L - X,
            "promised_tokens": L,
            "server_hit_tokens": requests["server_hit_tokens"].astype("Int64"),
            "lookup_status": status,
            "chunk_size": C,
            "tp_size": requests["tp_size"].to_numpy(dtype=np.int64),
            "engine": E,
            "external": X,
            "last_token": (P > 0).astype(np.int64),
            "load_failed": L - X,
        }
    )


def external_by_source(
    requests: pd.DataFrame, E: np.ndarray, X: np.ndarray, H: np.ndarray
) -> dict[str, np.ndarray]:
    """``external`` ``[E, E+X)`` per hit source: its overlap with the server's hit laid out
    as :mod:`testbed.core.hit_sources` lays it out (L1's chunks first, then each lower tier's,
    by the per-tier hit tokens the request span recorded; without them, all L1's)."""
    lower = {
        s: requests[f"hit_{s}_tokens"].to_numpy(dtype=np.int64)
        if f"hit_{s}_tokens" in requests
        else np.zeros(len(requests), dtype=np.int64)
        for s in HIT_SOURCES[1:]
    }
    start = np.maximum(H - sum(lower.values(), np.zeros(len(requests), dtype=np.int64)), 0)
    low, high = E, E + X
    result = {"external_host": np.zeros(len(requests), dtype=np.int64)}
    for source in HIT_SOURCES[1:]:
        end = start + lower[source]
        result[f"external_{source}"] = np.clip(
            np.minimum(high, end) - np.maximum(low, start), 0, None
        ).astype(np.int64)
        start = end
    lower_total = np.sum([result[f"external_{s}"] for s in HIT_SOURCES[1:]], axis=0)
    result["external_host"] = (X - lower_total).astype(np.int64)
    return result


def loaded_tokens(
    requests: pd.DataFrame, E: np.ndarray, L: np.ndarray, items: pd.DataFrame
) -> np.ndarray:
    """X per request: ``min(min over TP ranks of f_rank, E + L) - E`` (vLLM recomputes from
    the first failed block), where f_rank is the rank's first failed token, +inf when it
    loaded everything, and E when a rank has no retrieve item although L > 0."""
    tp = requests["tp_size"].to_numpy(dtype=np.int64)
    ids = requests["request_id"].astype(str)
    if len(items):
        tp_of = pd.Series(tp, index=ids.to_numpy())
        tp_of = tp_of[~tp_of.index.duplicated()]
        expected = items["request_id"].map(tp_of).fillna(0)
        items = items[(items["rank"] >= 0) & (items["rank"] < expected)]
    per_rank = items.groupby(["request_id", "rank"])["first_failed_token"].min().reset_index()
    per_request = per_rank.groupby("request_id").agg(
        first_failed=("first_failed_token", "min"), num_ranks=("rank", "nunique")
    )
    first_failed = ids.map(per_request["first_failed"]).to_numpy(dtype=float)
    num_ranks = ids.map(per_request["num_ranks"]).fillna(0).to_numpy(dtype=np.int64)
    first_failed = np.where(num_ranks < tp, E, np.nan_to_num(first_failed, nan=np.inf))
    loaded = np.minimum(first_failed, E + L) - E
    return np.where(L > 0, np.clip(loaded, 0, L), 0).astype(np.int64)


def _regions(
    P: np.ndarray,
    C: np.ndarray,
    E: np.ndarray,
    L: np.ndarray,
    H: np.ndarray,
    status: np.ndarray,
    routing: tuple[np.ndarray, np.ndarray],
) -> dict[str, np.ndarray]:
    """The token counts settled by arithmetic, and the region ``[chunk_start, chunk_end)``
    whose tokens take their chunk's cause from the chunk log; tokens of the ``routing`` range
    are left out of each (the chunk causes leave them out per chunk)."""
    last = np.maximum(P - 1, 0)
    low = E + L  # tokens below were hit, loaded or failed to load
    complete_end = (P // C) * C  # the end of the prompt's last complete chunk
    partial_start = np.maximum(low, complete_end)
    partial = np.clip(last - partial_start, 0, None) - overlap(partial_start, last, *routing)
    full_end = np.minimum(last, complete_end)
    rest = np.clip(full_end - low, 0, None) - overlap(low, full_end, *routing)
    unavailable = status == LOOKUP_UNAVAILABLE
    refused = status == LOOKUP_REFUSED
    no_answer = unavailable | refused  # no hit was reported: nothing to read from the log
    held_end = (H // C) * C  # the server held these chunks at lookup
    only_end = np.maximum(np.minimum(full_end, held_end), low)
    engine_only = np.where(no_answer, 0, only_end - low - overlap(low, only_end, *routing))
    chunk_start = np.maximum(low, held_end)
    return {
        "partial_chunk": partial,
        "unavailable": np.where(unavailable, rest, 0),
        "refused": np.where(refused, rest, 0),
        "engine_only": engine_only,
        "chunk_start": chunk_start,
        "chunk_end": np.where(no_answer, chunk_start, np.maximum(full_end, chunk_start)),
        "routing_start": routing[0],
        "routing_end": routing[1],
    }


# ---------------------------------------------------------------------------------------------
# Columns
# ---------------------------------------------------------------------------------------------


def _numbers(frame: pd.DataFrame, name: str) -> pd.Series:
    if name not in frame:
        return pd.Series(np.nan, index=frame.index, dtype=float)
    return pd.to_numeric(frame[name]).astype(float)


def _ints(frame: pd.DataFrame, name: str, fallback: str | None = None) -> np.ndarray:
    values = _numbers(frame, name)
    if fallback is not None and fallback in frame:
        values = values.fillna(pd.to_numeric(frame[fallback], errors="coerce"))
    return values.fillna(0).to_numpy(dtype=np.int64)


def _strings(frame: pd.DataFrame, name: str) -> pd.Series:
    if name not in frame:
        return pd.Series("", index=frame.index, dtype=object)
    return frame[name].astype(object).where(frame[name].notna(), "").astype(str)
