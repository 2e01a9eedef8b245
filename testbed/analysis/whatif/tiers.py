"""What-if over tiers: hit tokens of L1 (``host``) and L2 (``disk``) at every capacity pair.

**One pass** (``method = "one_pass"``, an inclusive LRU hierarchy: ``write_through`` +
``retain`` + ``lru`` in both tiers). Every reference reaches every tier, so each tier holds
the most recent keys of one recency stack (Mattson's inclusion): at capacities ``C1 <= C2``
chunks, a query whose prefix distance is ``D_m`` (:mod:`.stack`) hits iff ``D_m <= C2``, and
is served by L1 iff its own distance ``d_m <= C1``, else by L2. (``C2 < C1``: the hierarchy
holds the ``C1`` most recent keys, all in L1.) The same stack result gives every pair. Hit
chunks become tokens as a run's accounting credits the server's per-tier counts
(:func:`credit_tiers`, :mod:`testbed.core.hit_sources`): whole chunks for a workload, the
external hit ``[E, E + X)`` for a run, L1's chunks laid out first.

**Simulated** (``method = "simulated"``): ``write_back``, ``selective:N`` and ``promotion
none``, where no single stack orders both tiers, are replayed per configuration by
:func:`testbed.models.tier_sim.replay_tiers`. Belady's MIN over the hierarchy's whole
capacity (``max(C1, C2)``) stands beside every point as the bound on its total hit
(``belady_hit_tokens``; simulated, as MIN always is).

:func:`tier_table` returns one row per (chunk size, policy, L1, L2) with METRICS.md's
columns ("What-if over tiers").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pandas as pd

from testbed.analysis.whatif.curves import query_weights
from testbed.analysis.whatif.stack import COLD, StackResult
from testbed.models.access_trace import RUN, AccessTrace
from testbed.models.cache_sim import replay
from testbed.models.links import TierProfile, tier_profile
from testbed.models.tier_sim import TierPolicy, replay_tiers
from testbed.models.tier_time import tiered_ttft_s
from testbed.models.time_model import TimeModel

ONE_PASS = "one_pass"
SIMULATED = "simulated"
INCLUSIVE = TierPolicy()
"""``write_through`` + ``retain``: the hierarchy one pass predicts exactly."""


@dataclass(frozen=True)
class TierTime:
    """What a point's projected TTFT needs: the time model, the links, bytes per token."""

    model: TimeModel
    links: TierProfile
    bytes_per_token: float


@dataclass(frozen=True)
class TierGrid:
    """The capacity pairs (tokens) and policies of a tier what-if."""

    l1_tokens: tuple[int, ...] = ()
    """L1 capacities (tokens); empty: :func:`default_tier_grid`'s."""
    l2_tokens: tuple[int, ...] = ()
    policies: tuple[TierPolicy, ...] = (INCLUSIVE,)
    """Policies shown; the inclusive one in one pass, every other one simulated."""
    belady: bool = True
    time_profile: str | None = None
    """A time model (``h100``, ...) to project each point's mean TTFT under (``None``: none)."""
    links: str = "gen5"
    """The tier profile (:data:`testbed.models.links.TIER_PROFILES`) of the projection."""

    def __post_init__(self) -> None:
        if not self.policies:
            raise ValueError("a tier what-if needs at least one tier policy")
        tier_profile(self.links)  # a clear error for an unknown name
        if min(self.l1_tokens, default=0) < 0 or min(self.l2_tokens, default=0) < 0:
            raise ValueError("tier capacities must be >= 0 tokens")


def one_pass_tiers(
    trace: AccessTrace, stack: StackResult, l1_tokens: int, l2_tokens: int
) -> tuple[np.ndarray, np.ndarray]:
    """float64 per request: hit tokens served by L1 and by L2 of the inclusive hierarchy."""
    c1 = l1_tokens // trace.chunk_size
    c2 = max(l2_tokens // trace.chunk_size, c1)
    request = trace.query_request
    prefix = stack.prefix_distances
    hit = (request >= 0) & (prefix != COLD) & (prefix <= c2)
    host = hit & (stack.distances <= c1)
    index = np.where(request >= 0, request, 0)
    size = trace.num_requests
    return credit_tiers(
        trace,
        np.bincount(index[host], minlength=size),
        np.bincount(index[hit], minlength=size),
    )


def simulated_tiers(
    trace: AccessTrace, l1_tokens: int, l2_tokens: int, policy: TierPolicy
) -> tuple[np.ndarray, np.ndarray]:
    """As :func:`one_pass_tiers`, by replaying the hierarchy under ``policy``."""
    outcome = replay_tiers(
        trace.request_keys(), l1_tokens // trace.chunk_size, l2_tokens // trace.chunk_size, policy
    )
    host = np.asarray(outcome.tier_chunks(0), dtype=np.int64)
    hit = np.asarray([len(tiers) for tiers in outcome.hit_tiers], dtype=np.int64)
    return credit_tiers(trace, host, hit)


def credit_tiers(
    trace: AccessTrace, host_chunks: np.ndarray, hit_chunks: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """float64 per request: the hit tokens of L1 and L2, from each request's hit chunks and
    how many of them L1 held, by the hit-source layout (:mod:`testbed.core.hit_sources`: L1's
    chunks first) that a run's accounting applies to the server's counts. A workload credits
    whole chunks; a run its external hit ``[E, E + X)`` (:func:`.curves.query_weights`)."""
    size = trace.chunk_size
    host_end = host_chunks.astype(np.float64) * size
    hit_end = hit_chunks.astype(np.float64) * size
    if trace.mode != RUN:
        return host_end, hit_end - host_end
    engine = trace.engine_hit_tokens.astype(np.float64)
    prompts = trace.prompt_tokens.astype(np.float64)
    external = np.maximum(0.0, np.minimum(hit_end, prompts - 1) - engine)
    host = np.clip(host_end - engine, 0.0, external)
    return host, external - host


def tier_table(
    trace: AccessTrace, stack: StackResult, grid: TierGrid, time: TierTime | None = None
) -> pd.DataFrame:
    """Every (policy, L1, L2) point of ``grid`` over one trace (see the module docstring);
    with ``time``, each point's mean projected TTFT with its hits by tier and without any."""
    rows: list[dict[str, Any]] = []
    prompt = int(trace.prompt_tokens.sum())
    belady = _belady(trace, grid) if grid.belady else {}
    for policy in grid.policies:
        for l1 in sorted(set(grid.l1_tokens)):
            for l2 in sorted(set(grid.l2_tokens)):
                if policy.inclusive:
                    host, disk = one_pass_tiers(trace, stack, l1, l2)
                    method = ONE_PASS
                else:
                    host, disk = simulated_tiers(trace, l1, l2, policy)
                    method = SIMULATED
                row = _row(trace, policy, method, l1, l2, host, disk, prompt, belady, stack)
                if time is not None:
                    row |= _ttft(trace, time, host, disk)
                rows.append(row)
    return pd.DataFrame(rows)


def _ttft(trace: AccessTrace, time: TierTime, host: np.ndarray, disk: np.ndarray) -> dict[str, Any]:
    """Mean projected TTFT (ms) with the point's hits by tier and with none (a run keeps its
    engine hits in both: they are not part of the prompt the projection computes)."""
    engine = trace.engine_hit_tokens.astype(np.float64)
    prompts = trace.prompt_tokens.astype(np.float64) - engine
    size = time.bytes_per_token
    with_hits = tiered_ttft_s(
        time.model, time.links, prompts, {"host": host, "disk": disk}, bytes_per_token=size
    )
    without = tiered_ttft_s(time.model, time.links, prompts, {}, bytes_per_token=size)
    empty = not len(prompts)
    return {
        "time_profile": time.model.name,
        "tier_profile": time.links.name,
        "ttft_mean_ms": None if empty else 1e3 * float(with_hits.mean()),
        "ttft_no_cache_mean_ms": None if empty else 1e3 * float(without.mean()),
    }


def _row(
    trace: AccessTrace,
    policy: TierPolicy,
    method: str,
    l1: int,
    l2: int,
    host: np.ndarray,
    disk: np.ndarray,
    prompt: int,
    belady: dict[int, int],
    stack: StackResult,
) -> dict[str, Any]:
    host_tokens, disk_tokens = int(round(host.sum())), int(round(disk.sum()))
    denominator = max(prompt, 1)
    total_chunks = max(l1, l2) // trace.chunk_size
    return {
        "chunk_size": trace.chunk_size,
        "tier_write": policy.write,
        "tier_promote": policy.promote,
        "method": method,
        "exact": method == ONE_PASS and stack.sample_rate >= 1.0,
        "l1_capacity_tokens": l1,
        "l2_capacity_tokens": l2,
        "host_hit_tokens": host_tokens,
        "disk_hit_tokens": disk_tokens,
        "hit_tokens": host_tokens + disk_tokens,
        "prompt_tokens": prompt,
        "host_hit_rate": host_tokens / denominator,
        "disk_hit_rate": disk_tokens / denominator,
        "token_hit_rate": (host_tokens + disk_tokens) / denominator,
        "belady_hit_tokens": belady.get(total_chunks),
    }


def _belady(trace: AccessTrace, grid: TierGrid) -> dict[int, int]:
    """Belady's MIN at every total capacity of the grid (chunks -> hit tokens)."""
    keys = trace.request_keys()
    tokens, _ = query_weights(trace)
    totals = {max(l1, l2) // trace.chunk_size for l1 in grid.l1_tokens for l2 in grid.l2_tokens}
    result = {}
    for chunks in sorted(totals):
        hit_chunks = replay(keys, "belady", chunks).hit_chunks
        result[chunks] = _prefix_tokens(trace, tokens, hit_chunks)
    return result


def _prefix_tokens(trace: AccessTrace, tokens: np.ndarray, hit_chunks: Sequence[int]) -> int:
    total = 0.0
    offsets = trace.query_offsets
    for step in np.flatnonzero(trace.step_request >= 0).tolist():
        start = int(offsets[step])
        total += float(tokens[start : start + hit_chunks[int(trace.step_request[step])]].sum())
    return int(round(total))


def default_tier_grid(grid: TierGrid, stack: StackResult, chunk_size: int) -> TierGrid:
    """``grid`` with its empty capacity tuples filled: L1 at 2% and 10% of the distinct chunks,
    L2 at eight geometric points from 5% to 100% of them (tokens, multiples of the chunk)."""
    top = max(stack.num_distinct_keys, 1)
    l1 = grid.l1_tokens or tuple(max(1, round(top * f)) * chunk_size for f in (0.02, 0.1))
    l2 = grid.l2_tokens or tuple(
        int(k) * chunk_size
        for k in np.unique(np.rint(np.geomspace(max(1, top / 20), top, 8)).astype(np.int64))
    )
    return replace(grid, l1_tokens=l1, l2_tokens=l2)
