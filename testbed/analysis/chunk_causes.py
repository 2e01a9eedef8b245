"""The chunk log's side of attribution: why the chunks a request's lookup missed were missing.

:func:`first_lookup_rows` reads each session's first settled lookup from the server's chunk
event log (:mod:`testbed.analysis.chunklog`) with each chunk's own cause: ``hit``,
``in_flight`` (reserved, not committed), ``capacity`` (absent, but an object of it was committed
before the lookup, same server process) or ``cold`` (never committed before); a chunk that hit
behind an earlier miss takes the cause of the nearest earlier chunk that missed.
:func:`chunk_causes` counts a request's tokens per cause over the token range attribution
leaves to the log (:func:`testbed.analysis.attribution.attribute`). METRICS.md defines them.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from testbed.analysis.routing import overlap

CHUNK_HIT, CHUNK_IN_FLIGHT, CHUNK_ABSENT = "hit", "in_flight", "absent"
"""A lookup row's ``status``."""
PREFETCH_TIMEOUT, TIER_READ_FAILED = "prefetch_timeout", "tier_read_failed"
"""Lookup row statuses of a server with tiers: the chunk was matched below L1 but its
prefetch had not reached L1 when the lookup was answered, or its read failed (or did not
verify)."""
STORE_DROPPED = "store_dropped"
"""The ``cause`` of a ``drop`` row for a write the server dropped under back-pressure (its
queue full): a later lookup that finds the chunk absent lost it to that drop."""
CHUNK_CAUSES = ("in_flight", "capacity", "cold", PREFETCH_TIMEOUT, TIER_READ_FAILED, STORE_DROPPED)
"""The causes read from the chunk log (token categories of attribution)."""


def first_lookup_rows(chunks: pd.DataFrame) -> pd.DataFrame:
    """The lookup rows of each session's first settled lookup, ordered by session and position:
    ``session_id`` (categorical, the log's categories), ``position``, ``status``, ``cause``
    (the chunk's own: ``hit``, ``in_flight``, ``capacity`` or ``cold``), ``effective`` (a hit
    behind an earlier miss takes that miss's cause), ``seq``, ``server``, ``span_id``,
    ``object_key`` (:func:`object_keys`)."""
    is_lookup = (chunks["event"] == "lookup").to_numpy()
    keys = object_keys(chunks)
    lookups = chunks[is_lookup]
    lookup_keys = keys[is_lookup]
    session = lookups["session_id"].cat.codes.to_numpy()
    server = lookups["server"].cat.codes.to_numpy()
    span = lookups["span_id"].cat.codes.to_numpy()
    # A session's first settled lookup: the (server, span) of its earliest row.
    order = np.lexsort((lookups["seq"].to_numpy(), lookups["time_ns"].to_numpy()))
    first = np.full(len(lookups["session_id"].cat.categories), -1, dtype=np.int64)
    earliest = order[::-1]  # assigning in reverse leaves each session's earliest row
    first[session[earliest]] = earliest
    leader = first[session]
    keep = (server == server[leader]) & (span == span[leader])
    picked = np.flatnonzero(keep)
    picked = picked[np.lexsort((lookups["position"].to_numpy()[picked], session[picked]))]
    rows = lookups.iloc[picked]
    cause = _own_causes(chunks, keys, rows, lookup_keys[picked])
    effective = _behind_misses(cause, session[picked])
    return pd.DataFrame(
        {
            "session_id": rows["session_id"].array,
            "position": rows["position"].to_numpy(),
            "status": rows["status"].array,
            "cause": pd.Categorical.from_codes(cause, _CAUSES),
            "effective": pd.Categorical.from_codes(effective, _CAUSES),
            "seq": rows["seq"].to_numpy(),
            "server": rows["server"].array,
            "span_id": rows["span_id"].array,
            "object_key": lookup_keys[picked],
        }
    )


_CAUSES = (CHUNK_HIT, "in_flight", "capacity", "cold", *CHUNK_CAUSES[3:])  # codes 0..6


def _own_causes(
    chunks: pd.DataFrame, keys: np.ndarray, rows: pd.DataFrame, row_keys: np.ndarray
) -> np.ndarray:
    """Cause codes of lookup ``rows`` (see :data:`_CAUSES`): hit, in flight, or absent and
    then capacity if an object of the chunk was committed (same server process) before."""
    commits = (chunks["event"] == "commit").to_numpy()
    first_commit = np.full(int(keys.max(initial=-1)) + 1, np.iinfo(np.int64).max)
    np.minimum.at(first_commit, keys[commits], chunks["seq"].to_numpy()[commits])
    seq = rows["seq"].to_numpy()
    committed_before = first_commit[row_keys] < seq
    drops = ((chunks["event"] == "drop") & (chunks["cause"] == STORE_DROPPED)).to_numpy()
    last_drop = np.full(len(first_commit), -1, dtype=np.int64)
    np.maximum.at(last_drop, keys[drops], chunks["seq"].to_numpy()[drops])
    dropped_before = (last_drop[row_keys] >= 0) & (last_drop[row_keys] < seq)
    status = rows["status"]
    absent = (status == CHUNK_ABSENT).to_numpy()
    return np.select(
        [
            (status == CHUNK_HIT).to_numpy(),
            (status == CHUNK_IN_FLIGHT).to_numpy(),
            (status == PREFETCH_TIMEOUT).to_numpy(),
            (status == TIER_READ_FAILED).to_numpy(),
            absent & dropped_before,
            committed_before,
        ],
        [0, 1, 4, 5, 6, 2],
        default=3,
    ).astype(np.int8)


def _behind_misses(cause: np.ndarray, session: np.ndarray) -> np.ndarray:
    """Each row's cause, a hit taking the cause of the nearest earlier miss of its session
    (rows ordered by session and position)."""
    index = np.arange(len(cause))
    last_miss = np.maximum.accumulate(np.where(cause != 0, index, -1)) if len(cause) else index
    same_session = (last_miss >= 0) & (session[np.maximum(last_miss, 0)] == session)
    return np.where(same_session, cause[np.maximum(last_miss, 0)], cause).astype(np.int8)


def object_keys(chunks: pd.DataFrame) -> np.ndarray:
    """One integer per row (in row order) naming the object identity the row is about:
    (server process, namespace, chunk hash). Ranks share it: a lookup is chunk-level."""
    hashes, _ = pd.factorize(chunks["chunk_hash"])
    namespaces = chunks["namespace"].cat.codes.to_numpy().astype(np.int64)
    servers = chunks["server"].cat.codes.to_numpy().astype(np.int64)
    hash_width = int(hashes.max(initial=0)) + 1
    namespace_width = int(namespaces.max(initial=0)) + 1
    return (servers * namespace_width + namespaces) * hash_width + hashes.astype(np.int64)


def chunk_causes(
    requests: pd.DataFrame, regions: dict[str, np.ndarray], chunks: pd.DataFrame | None
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Tokens of ``[chunk_start, chunk_end)`` per chunk cause, and whether each request's
    causes came from the log (missing lookup rows count as cold, unresolved)."""
    num = len(requests)
    start, end = regions["chunk_start"], regions["chunk_end"]
    routed_start, routed_end = regions["routing_start"], regions["routing_end"]
    need = end - start - overlap(start, end, routed_start, routed_end)
    counts = {name: np.zeros(num, dtype=np.int64) for name in CHUNK_CAUSES}
    if chunks is None:
        counts["cold"] = need.copy()
        return counts, need == 0
    rows = first_lookup_rows(chunks)
    # The request of each lookup row, through the session id (one request per session).
    categories = pd.Index(rows["session_id"].cat.categories.astype(str))
    wanted = np.flatnonzero(need > 0)
    codes = categories.get_indexer(requests["session_id"].astype(str).to_numpy()[wanted])
    request_of = np.full(len(categories), -1, dtype=np.int64)
    request_of[codes[codes >= 0]] = wanted[codes >= 0]
    request = request_of[rows["session_id"].cat.codes.to_numpy()]
    joined = request >= 0
    request = request[joined]
    size = requests["chunk_size"].to_numpy(dtype=np.int64)[request]
    position = rows["position"].to_numpy(dtype=np.int64)[joined]
    row_start = np.maximum(position * size, start[request])
    row_end = np.minimum((position + 1) * size, end[request])
    tokens = np.clip(row_end - row_start, 0, None) - overlap(
        row_start, row_end, routed_start[request], routed_end[request]
    )
    effective = rows["effective"].cat.codes.to_numpy()[joined]
    per_cause = {
        name: np.bincount(request, weights=tokens * (effective == code), minlength=num)
        for code, name in enumerate(_CAUSES)
    }
    for name in CHUNK_CAUSES:
        counts[name] = per_cause[name].astype(np.int64)
    assigned = np.sum(list(per_cause.values()), axis=0).astype(np.int64)
    # Tokens of chunks the log says nothing about (no lookup rows, or a hit with no miss
    # before it, which a consistent log does not have): cold, unresolved.
    unexplained = need - assigned + per_cause[CHUNK_HIT].astype(np.int64)
    counts["cold"] = counts["cold"] + unexplained
    return counts, unexplained == 0
