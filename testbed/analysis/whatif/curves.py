"""Hit-rate curves: from stack distances to hit tokens at every capacity.

A query (chunk ``m`` of request ``r``'s first lookup) adds ``w`` hit tokens at every capacity
``c >= D_m`` (its prefix distance, :mod:`.stack`). With the oracle's semantics (a workload)
``w = C``: a request hits whole chunks. For a run, the curve predicts the *external* hit
``X_r(c) = max(0, min(H_r(c), P_r - 1) - E_r)``: vLLM computes the last prompt token itself and
its own prefix cache took ``E_r`` first. ``H_r`` grows by ``C`` per chunk, so chunk ``m`` adds
``w = x((m + 1) C) - x(m C)`` with ``x(h) = max(0, min(h, P_r - 1) - E_r)``: still one weight
per query, and the whole curve is one weighted histogram of ``D`` and its cumulative sum.

Capacities are in tokens of KV; a cache of ``T`` tokens holds ``T // C`` chunks (as an oracle
run converts a capacity). ``None`` means unlimited.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from testbed.analysis.whatif.stack import COLD, StackResult
from testbed.models.access_trace import RUN, AccessTrace

FRACTIONS = (0.6, 0.8, 0.9, 0.95, 0.99)
"""Shares of the infinite cache's hits the miss-ratio gauge asks the capacity for."""


@dataclass(frozen=True)
class Point:
    """A hit rate at one capacity (one row of ``whatif.json``'s points)."""

    capacity_tokens: int | None
    token_hit_rate: float
    """``sum(hit_r) / sum(P_r)``; for a run, ``hit_r = E_r + X_r`` (METRICS.md)."""
    mean_request_hit_rate: float
    hit_tokens: int
    """``sum(hit_r)`` (for a run, engine hits included)."""
    external_hit_tokens: int
    """``sum(X_r)`` for a run; equal to ``hit_tokens`` for a workload (no engine)."""

    def row(self) -> dict[str, float | int | None]:
        return {
            "capacity_tokens": self.capacity_tokens,
            "token_hit_rate": self.token_hit_rate,
            "mean_request_hit_rate": self.mean_request_hit_rate,
            "hit_tokens": self.hit_tokens,
            "external_hit_tokens": self.external_hit_tokens,
        }


@dataclass(frozen=True, eq=False)
class LRUCurve:
    """The LRU hit curve of one trace at every capacity (exact unless sampled)."""

    chunk_size: int
    mode: str
    num_requests: int
    prompt_tokens: int
    base_hit_tokens: int
    """``sum(E_r)`` (0 for a workload): hits no capacity changes."""
    base_rate_sum: float
    """``sum(E_r / P_r)``."""
    hit_tokens: np.ndarray
    """float64 ``[num_distinct + 1]``: variable hit tokens at ``c`` chunks (``c`` = index)."""
    rate_sum: np.ndarray
    """float64, same shape: the variable part of ``sum_r(hit_r / P_r)`` at ``c`` chunks."""
    sample_rate: float
    exact_window_keys: int
    """Distances up to about this many keys are exact even when sampled."""

    @property
    def num_distinct_keys(self) -> int:
        """Chunks the infinite cache ends up holding: beyond ``num_distinct * C`` tokens
        nothing changes."""
        return len(self.hit_tokens) - 1

    def at(self, capacity_tokens: int | None) -> Point:
        """The curve at one capacity (``None``: unlimited)."""
        if capacity_tokens is not None and capacity_tokens < 0:
            raise ValueError(f"capacity_tokens must be >= 0 or None, got {capacity_tokens}")
        index = (
            self.num_distinct_keys
            if capacity_tokens is None
            else min(capacity_tokens // self.chunk_size, self.num_distinct_keys)
        )
        external = int(round(self.hit_tokens[index]))
        return _point(
            capacity_tokens,
            self.base_hit_tokens + external,
            self.base_rate_sum + float(self.rate_sum[index]),
            external,
            self.prompt_tokens,
            self.num_requests,
        )

    def points(self, capacities_tokens: Sequence[int | None]) -> list[Point]:
        return [self.at(capacity) for capacity in capacities_tokens]

    def min_capacity_tokens(self, fraction: float) -> int:
        """The smallest capacity (tokens, a multiple of ``C``) whose LRU keeps ``fraction``
        of the infinite cache's variable hits (external hits for a run)."""
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        total = self.hit_tokens[-1]
        if total <= 0:
            return 0
        target = fraction * total * (1 - 1e-12)
        return int(np.searchsorted(self.hit_tokens, target, side="left")) * self.chunk_size

    def breakpoints(self) -> pd.DataFrame:
        """Every capacity at which the curve steps (the exact curve, compressed)."""
        steps = np.flatnonzero(np.diff(self.hit_tokens, prepend=-1.0) != 0)
        hits = self.base_hit_tokens + np.rint(self.hit_tokens[steps]).astype(np.int64)
        denominator = max(self.prompt_tokens, 1)
        return pd.DataFrame(
            {
                "chunk_size": self.chunk_size,
                "capacity_tokens": steps.astype(np.int64) * self.chunk_size,
                "hit_tokens": hits,
                "token_hit_rate": hits / denominator,
                "mean_request_hit_rate": (self.base_rate_sum + self.rate_sum[steps])
                / max(self.num_requests, 1),
            }
        )


def lru_curve(trace: AccessTrace, stack: StackResult) -> LRUCurve:
    """The LRU curve of ``trace`` from its stack distances."""
    tokens, rates = query_weights(trace)
    size = stack.num_distinct_keys + 1
    # Bin c: hits from capacity c chunks on; cold queries go to the last bin, which is dropped.
    # (A sampled estimate can exceed the distinct count by one: it is clipped to it.)
    distances = stack.prefix_distances
    bins = np.where(distances == COLD, size, np.minimum(distances, size - 1))
    hit_tokens = np.bincount(bins, weights=tokens, minlength=size + 1)[:size].cumsum()
    rate_sum = np.bincount(bins, weights=rates, minlength=size + 1)[:size].cumsum()
    engine = trace.engine_hit_tokens
    prompts = trace.prompt_tokens
    return LRUCurve(
        chunk_size=trace.chunk_size,
        mode=trace.mode,
        num_requests=trace.num_requests,
        prompt_tokens=int(prompts.sum()),
        base_hit_tokens=int(engine.sum()),
        base_rate_sum=float((engine / np.maximum(prompts, 1)).sum()),
        hit_tokens=hit_tokens,
        rate_sum=rate_sum,
        sample_rate=stack.sample_rate,
        exact_window_keys=stack.exact_window_keys,
    )


def query_weights(trace: AccessTrace) -> tuple[np.ndarray, np.ndarray]:
    """Per query: hit tokens it adds once its prefix is cached, and that over ``P_r``.

    Queries of steps that answer for no request (later lookups) weigh nothing.
    """
    request = trace.query_request
    answered = request >= 0
    index = np.where(answered, request, 0)
    prompts = trace.prompt_tokens[index] if trace.num_requests else np.zeros(len(request))
    if trace.mode == RUN:
        engine = trace.engine_hit_tokens[index] if trace.num_requests else prompts
        start = trace.query_positions * trace.chunk_size
        tokens = _external(start + trace.chunk_size, prompts, engine) - _external(
            start, prompts, engine
        )
    else:
        tokens = np.full(len(request), trace.chunk_size, dtype=np.int64)
    tokens = np.where(answered, tokens, 0).astype(np.float64)
    return tokens, tokens / np.maximum(prompts, 1)


def request_hit_tokens(
    trace: AccessTrace, stack: StackResult, capacity_tokens: int | None
) -> np.ndarray:
    """int64 per request: the variable hit at one capacity (``H_r``; for a run ``X_r``)."""
    if capacity_tokens is None:
        chunks = np.iinfo(np.int64).max - 1
    else:
        chunks = capacity_tokens // trace.chunk_size
    tokens, _ = query_weights(trace)
    request = trace.query_request
    hit = (request >= 0) & (stack.prefix_distances <= chunks) & (stack.prefix_distances != COLD)
    return np.rint(
        np.bincount(request[hit], weights=tokens[hit], minlength=trace.num_requests)
    ).astype(np.int64)


def request_hits_point(
    trace: AccessTrace, capacity_tokens: int | None, hit_chunks: np.ndarray
) -> Point:
    """The point of a simulation that hit ``hit_chunks[r]`` leading chunks per request."""
    hit = np.asarray(hit_chunks, dtype=np.int64) * trace.chunk_size
    prompts = trace.prompt_tokens
    if trace.mode == RUN:
        external = _external(hit, prompts, trace.engine_hit_tokens)
        total = trace.engine_hit_tokens + external
    else:
        external = total = hit
    return _point(
        capacity_tokens,
        int(total.sum()),
        float((total / np.maximum(prompts, 1)).sum()),
        int(external.sum()),
        int(prompts.sum()),
        trace.num_requests,
    )


def capacity_grid(curve: LRUCurve, num_points: int, extra: Sequence[int] = ()) -> list[int | None]:
    """``num_points`` capacities spaced geometrically from one chunk to the infinite cache's
    size (multiples of ``C``), the ``extra`` ones, and ``None`` (unlimited), ascending."""
    top = max(curve.num_distinct_keys, 1)
    chunks = np.unique(np.rint(np.geomspace(1, top, max(num_points, 2))).astype(np.int64))
    capacities = {int(c) * curve.chunk_size for c in chunks} | {int(c) for c in extra}
    return [*sorted(capacities), None]


def max_abs_difference(
    reference: LRUCurve, other: LRUCurve, capacities_tokens: Sequence[int | None]
) -> float:
    """Largest ``|token_hit_rate|`` difference of two curves over the given capacities."""
    return max(
        abs(reference.at(c).token_hit_rate - other.at(c).token_hit_rate) for c in capacities_tokens
    )


def estimated_sampling_error(curve: LRUCurve, capacities_tokens: Sequence[int | None]) -> float:
    """The largest 1-sigma ``token_hit_rate`` error a sampled curve is expected to have over
    the given capacities (0 for an exact curve).

    At rate ``R`` the keys beyond the exact window (``c - w`` of a distance of ``c`` keys,
    ``w`` = :attr:`LRUCurve.exact_window_keys`) are estimated from about ``R (c - w)`` sampled
    keys: a standard deviation of ``s = sqrt((c - w)(1 - R) / R)`` keys. The hit rate then
    moves by half the curve's rise between ``c - s`` and ``c + s``.
    """
    rate = curve.sample_rate
    if rate >= 1.0:
        return 0.0
    worst = 0.0
    for capacity in capacities_tokens:
        if capacity is None:
            continue
        chunks = capacity // curve.chunk_size
        sigma = float(np.sqrt(max(0, chunks - curve.exact_window_keys) * (1 - rate) / rate))
        if sigma == 0.0:
            continue
        low = max(0, int(chunks - sigma)) * curve.chunk_size
        high = int(np.ceil(chunks + sigma)) * curve.chunk_size
        worst = max(worst, (curve.at(high).token_hit_rate - curve.at(low).token_hit_rate) / 2)
    return worst


def _external(hit: np.ndarray, prompts: np.ndarray, engine: np.ndarray) -> np.ndarray:
    return np.maximum(0, np.minimum(hit, prompts - 1) - engine)


def _point(
    capacity_tokens: int | None,
    hit_tokens: int,
    rate_sum: float,
    external_hit_tokens: int,
    prompt_tokens: int,
    num_requests: int,
) -> Point:
    return Point(
        capacity_tokens=capacity_tokens,
        token_hit_rate=hit_tokens / prompt_tokens if prompt_tokens else 0.0,
        mean_request_hit_rate=rate_sum / num_requests if num_requests else 0.0,
        hit_tokens=hit_tokens,
        external_hit_tokens=external_hit_tokens,
    )
