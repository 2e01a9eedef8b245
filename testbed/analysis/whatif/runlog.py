"""A run's recorded external-cache access stream, from its chunk event log and request spans.

The server's chunk event log (:mod:`testbed.analysis.chunklog`) holds, in order, every
settled lookup (one row per chunk asked for, with its status), every commit and every touch.
As an LRU stack sees them:

- a lookup is a step: its rows are the queries (chunks in position order from 0); the rows
  with status ``hit`` are references too (the server touches what it finds);
- ``commit`` rows insert and ``touch`` rows refresh: references. Consecutive ones form a step
  of references only. Reservations, aborts, evictions and drops are not references: what a
  cache of another capacity would have evicted is exactly what the curve works out.
- a ``commit`` a prefetch made (cause ``tier_promote``: a chunk brought up into L1 from a
  tier below for a lookup) is not a reference: it is logged when its read completes, before
  the lookup that asked settles, and the lookup's own ``hit`` row is that access. Counted as
  one, it would put the chunk at the top of the stack just before the query it answers.

Identity is the chunk (namespace, chunk hash): a chunk's TP-rank objects move together under
LRU. Touch rows carry no position; they take the position the chunk has in lookup and commit
rows (a prefix-chained key always sits at the same position).

Per request (one connector request span, :func:`testbed.analysis.attribution.attribution`):
``P``, ``E`` and the measured external hit ``X``; its first settled lookup is the step whose
queries the curve answers for it. A later lookup of the same session (after preemption) still
references, and answers for nobody.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from testbed.core.run_dir import RunDir
from testbed.models.access_trace import RUN, AccessTrace
from testbed.spec.runspec import RunSpec

REFERENCE_EVENTS = ("commit", "touch")
PROMOTION_CAUSE = "tier_promote"
"""Chunk log cause of an L1 commit a prefetch made (``server.tiers.hierarchy.TIER_PROMOTE``)."""


@dataclass(frozen=True, eq=False)
class RunSource:
    """A run directory reduced to what a what-if needs."""

    path: Path
    spec: RunSpec
    trace: AccessTrace
    """At the run's chunk size."""
    requests: pd.DataFrame
    """One row per request: ``request_id, session_id, group, prompt_tokens,
    engine_hit_tokens, external_hit_tokens`` (measured)."""

    @property
    def capacity_tokens(self) -> int | None:
        """The run's cache capacity in tokens of KV (``None``: unlimited)."""
        capacity = self.spec.capacity()
        if capacity is None:
            return None
        return capacity // self.spec.kv_profile.stored_bytes_per_token(self.spec.tp)


def load_run_source(run_dir: Path | str) -> RunSource:
    """Reads ``run_dir``'s spec, chunk log and request accounting."""
    from testbed.analysis.attribution import attribution
    from testbed.analysis.chunklog import load_chunk_log

    path = Path(run_dir)
    spec = run_spec(path)
    accounted = attribution(path)
    requests = pd.DataFrame(
        {
            "request_id": accounted["request_id"].astype(str).to_numpy(),
            "session_id": accounted["session_id"].astype(str).to_numpy(),
            "group": accounted["group"].fillna("").astype(str).to_numpy(),
            "prompt_tokens": accounted["prompt_tokens"].astype(np.int64).to_numpy(),
            "engine_hit_tokens": accounted["engine_hit_tokens"].astype(np.int64).to_numpy(),
            "external_hit_tokens": accounted["external_hit_tokens"].astype(np.int64).to_numpy(),
        }
    )
    trace = run_trace(load_chunk_log(path), requests, spec.chunk_size)
    return RunSource(path, spec, trace, requests)


def run_spec(run_dir: Path) -> RunSpec:
    """The run's resolved spec (``spec.json``)."""
    spec_path = RunDir(run_dir).spec
    if not spec_path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no {spec_path.name})")
    values: dict[str, Any] = json.loads(spec_path.read_text())
    known = set(RunSpec.keys())
    return RunSpec.from_mapping(
        {k: v for k, v in values.items() if k in known}, source=str(spec_path)
    )


def run_trace(chunks: pd.DataFrame, requests: pd.DataFrame, chunk_size: int) -> AccessTrace:
    """The access stream of a chunk log (columns of :mod:`testbed.analysis.chunklog`) for the
    ``requests`` (``session_id, group, prompt_tokens, engine_hit_tokens``)."""
    events = chunks["event"].astype(str).to_numpy()
    promoted = (events == "commit") & (chunks["cause"].astype(str).to_numpy() == PROMOTION_CAUSE)
    rows = chunks[np.isin(events, ("lookup", *REFERENCE_EVENTS)) & ~promoted]
    rows = rows.sort_values(["time_ns", "seq"], kind="stable").reset_index(drop=True)
    is_lookup = (rows["event"].astype(str) == "lookup").to_numpy()
    keys = (
        rows.groupby(["namespace", "chunk_hash"], observed=True, sort=False).ngroup().to_numpy()
        if len(rows)
        else np.zeros(0, dtype=np.int64)
    ).astype(np.int64)
    positions = _positions(rows["position"].to_numpy(dtype=np.int64), keys)
    session = rows["session_id"].astype(str).to_numpy()
    span = rows["span_id"].astype(str).to_numpy()
    new_step = np.ones(len(rows), dtype=bool)
    if len(rows):
        same_kind = is_lookup[1:] == is_lookup[:-1]
        same_lookup = (
            (session[1:] == session[:-1])
            & (span[1:] == span[:-1])
            & (positions[1:] > positions[:-1])
        )
        new_step[1:] = ~(same_kind & (~is_lookup[1:] | same_lookup))
    step_of_row = np.cumsum(new_step) - 1
    num_steps = int(new_step.sum())
    is_ref = ~is_lookup | (rows["status"].astype(str).to_numpy() == "hit")
    first_rows = np.flatnonzero(new_step)
    request_of_session = {s: i for i, s in enumerate(requests["session_id"].astype(str))}
    step_request = np.full(num_steps, -1, dtype=np.int64)
    answered: set[str] = set()
    for step, row in enumerate(first_rows):
        if is_lookup[row] and session[row] not in answered:
            answered.add(session[row])
            step_request[step] = request_of_session.get(session[row], -1)
    steps = np.arange(num_steps + 1)
    return AccessTrace(
        chunk_size=chunk_size,
        mode=RUN,
        num_keys=int(keys.max()) + 1 if len(keys) else 0,
        query_offsets=np.searchsorted(step_of_row[is_lookup], steps).astype(np.int64),
        query_keys=keys[is_lookup],
        query_positions=positions[is_lookup],
        ref_offsets=np.searchsorted(step_of_row[is_ref], steps).astype(np.int64),
        ref_keys=keys[is_ref],
        ref_positions=positions[is_ref],
        step_time_s=rows["time_ns"].to_numpy(dtype=np.int64)[first_rows] / 1e9,
        step_request=step_request,
        prompt_tokens=requests["prompt_tokens"].to_numpy(dtype=np.int64),
        engine_hit_tokens=requests["engine_hit_tokens"].to_numpy(dtype=np.int64),
        groups=requests["group"].fillna("").astype(str).to_numpy(dtype=object),
    )


def _positions(positions: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Rows without a position (touches) take their key's position from the other rows."""
    known = positions >= 0
    if known.all() or not len(keys):
        return positions
    by_key = np.full(int(keys.max()) + 1, -1, dtype=np.int64)
    np.maximum.at(by_key, keys[known], positions[known])
    return np.where(known, positions, by_key[keys])
