"""Routing decisions and the ``routing`` miss cause, from a fleet's ``kvcache.route`` spans.

A fleet (or the serve engine over several vLLM servers) records each routing decision in a
``kvcache.route`` span under the request's span: the router, the chosen instance, the router's
cost per instance and, per instance, the request's prefix its prefix cache held at the
decision (``kvcache.route.cached_tokens``). :func:`route_table` reads them, one row per
workload request; :func:`routing_region` says which prompt tokens of each request the
``routing`` category takes (METRICS.md):

    B = the chosen instance's cached prefix at the decision
    A = the longest cached prefix of any other instance at the decision
    routing = [max(E + L, B), min(A, P - 1))

i.e. the tokens the request computed (past its engine hit, its loads and failed loads; the last
token is always computed) that another instance's prefix cache held when it arrived, beyond
what the chosen instance held. With peers (P2P between per-instance servers) part of that
prefix is loaded from a peer instead: :func:`won_back` counts it, and ``routing`` is what was
lost for good. A router that always picks an instance holding the longest
prefix (the ``oracle``) has none by construction (``A <= B``).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from testbed.core.telemetry import attributes as a

ROUTE_COLUMNS = (
    "workload_request_id",
    "router",
    "instance",
    "clock_s",
    "cached_tokens",
    "costs",
    "load_tokens",
    "chosen_cached_tokens",
    "best_other_tokens",
    "best_other_instance",
)


def route_table(spans: pd.DataFrame) -> pd.DataFrame:
    """One row per routed workload request (empty without route spans): ``router``,
    ``instance`` (chosen), ``clock_s``, the per-instance lists ``cached_tokens``, ``costs``
    (``None`` for routers that weigh none) and ``load_tokens``, then ``chosen_cached_tokens``
    (B), ``best_other_tokens`` (A) and ``best_other_instance`` (the lowest-numbered other
    instance holding A; ``None`` when no other instance held anything)."""
    rows = spans[spans["name"] == a.ROUTE] if len(spans) else spans
    if rows.empty:
        return pd.DataFrame(columns=list(ROUTE_COLUMNS))
    rows = rows.drop_duplicates(a.REQUEST_ID)
    instance = pd.to_numeric(rows[a.INSTANCE]).astype("int64").to_numpy()
    cached = [np.asarray(v, dtype=np.int64) for v in rows[a.ROUTE_CACHED_TOKENS]]
    chosen, best, where = [], [], []
    for index, held in zip(instance, cached, strict=True):
        others = held.copy()
        others[index] = -1
        chosen.append(int(held[index]))
        best.append(max(int(others.max(initial=0)), 0))
        where.append(int(others.argmax()) if best[-1] > 0 else None)
    costs = rows[a.ROUTE_COSTS] if a.ROUTE_COSTS in rows else pd.Series(None, index=rows.index)
    return pd.DataFrame(
        {
            "workload_request_id": rows[a.REQUEST_ID].astype(str).to_numpy(),
            "router": rows[a.ROUTER].astype(str).to_numpy(),
            "instance": instance,
            "clock_s": pd.to_numeric(rows[a.ROUTE_CLOCK_S]).to_numpy(),
            "cached_tokens": [held.tolist() for held in cached],
            "costs": [_floats(v) for v in costs],
            "load_tokens": [_floats(v) for v in rows[a.ROUTE_LOAD_TOKENS]],
            "chosen_cached_tokens": np.asarray(chosen, dtype=np.int64),
            "best_other_tokens": np.asarray(best, dtype=np.int64),
            "best_other_instance": pd.array(where, dtype="Int64"),
        }
    )


def routing_region(
    workload_request_ids: pd.Series, low: np.ndarray, last: np.ndarray, routes: pd.DataFrame
) -> tuple[np.ndarray, np.ndarray]:
    """``[start, end)`` of each request's ``routing`` tokens (empty ranges for requests no
    route span names): ``low`` is ``E + L``, ``last`` is ``P - 1`` (module docstring)."""
    if routes.empty:
        zero = np.zeros(len(low), dtype=np.int64)
        return zero, zero
    by_id = routes.set_index("workload_request_id")
    ids = workload_request_ids.astype(object).where(workload_request_ids.notna(), "")
    held = ids.map(by_id["chosen_cached_tokens"]).fillna(0).to_numpy(dtype=np.int64)
    other = ids.map(by_id["best_other_tokens"]).fillna(0).to_numpy(dtype=np.int64)
    start = np.maximum(low, held)
    end = np.maximum(np.minimum(other, last), start)
    return start, end


def won_back(table: pd.DataFrame) -> np.ndarray:
    """Per request of a fleet table (``testbed.analysis.fleet.fleet_requests``), the routing
    loss a peer won back: its ``external_p2p`` tokens, the last of its loaded tokens
    ``[E + X − p2p, E + X)`` (the hit layout puts a peer's chunks last), inside
    ``[B, min(A, P − 1))``, what another instance's prefix cache held beyond the chosen one's
    (zeros without ``external_p2p`` or route spans)."""
    if "external_p2p" not in table or table.empty:
        return np.zeros(len(table), dtype=np.int64)
    loaded_end = (table["engine_hit_tokens"] + table["external_hit_tokens"]).to_numpy(np.int64)
    p2p = table["external_p2p"].fillna(0).to_numpy(np.int64)
    chosen, best = np.zeros(len(table), np.int64), np.zeros(len(table), np.int64)
    routes = zip(table["instance"], table["cached_tokens"], strict=True)
    for row, (instance, cached) in enumerate(routes):
        if pd.isna(instance) or cached is None:
            continue
        held = np.asarray(cached, dtype=np.int64)
        chosen[row] = held[int(instance)]
        best[row] = int(np.delete(held, int(instance)).max(initial=0))
    last = np.maximum(table["prompt_tokens"].to_numpy(np.int64) - 1, 0)
    return overlap(loaded_end - p2p, loaded_end, chosen, np.minimum(best, last))


def overlap(
    start: np.ndarray, end: np.ndarray, other_start: np.ndarray, other_end: np.ndarray
) -> np.ndarray:
    """Tokens ``[start, end)`` and ``[other_start, other_end)`` have in common, elementwise."""
    return np.clip(np.minimum(end, other_end) - np.maximum(start, other_start), 0, None)


def _floats(value: object) -> list[float] | None:
    if value is None or (np.isscalar(value) and pd.isna(value)):
        return None
    return [float(v) for v in value]  # type: ignore[attr-defined]
