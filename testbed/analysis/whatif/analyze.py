"""One what-if: traces at every chunk size asked for → curves, policy points, gauges, reuse.

:func:`what_if_workload` and :func:`what_if_run` build the traces (:mod:`.sources`,
:mod:`.runlog`) and call :func:`analyze`, which returns a :class:`~.results.WhatIf` (write it
with :func:`~.results.write_whatif`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from testbed.analysis.whatif import curves as c
from testbed.analysis.whatif.results import WhatIf
from testbed.analysis.whatif.reuse import reuse_quantiles, reuse_summary
from testbed.analysis.whatif.runlog import RunSource
from testbed.analysis.whatif.stack import stack_distances
from testbed.analysis.whatif.tiers import TierGrid, TierTime, default_tier_grid, tier_table
from testbed.analysis.whatif.timing import break_even_rows, time_models, time_rows
from testbed.models.access_trace import AccessTrace
from testbed.models.cache_sim import INFINITE, POLICIES, replay_flat
from testbed.models.hardware import Hardware
from testbed.models.links import tier_profile
from testbed.spec.runspec import RunSpec

SIMULATED_POLICIES = tuple(name for name in POLICIES if name != INFINITE)
"""The policies a what-if can show (``testbed.models.cache_sim``'s, the unlimited cache aside:
every what-if has it)."""


@dataclass(frozen=True)
class WhatIfOptions:
    """What to compute (the flags of ``kvtb whatif``)."""

    chunk_sizes: tuple[int, ...] | None = None
    """Chunk sizes of the curves (``None``: the source's own). From a run: multiples of its
    chunk size."""
    policies: tuple[str, ...] = ("lru", "belady")
    """Some of :data:`SIMULATED_POLICIES`: ``lru`` is the one-pass curve; the others are
    simulated at sampled capacities."""
    at_tokens: tuple[int, ...] = ()
    """Capacities (tokens) added as exact points to every curve and policy."""
    sample_rate: float = 1.0
    """SHARDS-style spatial sampling of the LRU stack (1.0: exact)."""
    sample_seed: int = 0
    grid_points: int = 48
    """LRU points per curve in ``whatif.json`` (geometric; the full curve is in Parquet)."""
    policy_points: int = 8
    """Capacities each simulated policy is run at (geometric, 1% to 100% of all chunks)."""
    fractions: tuple[float, ...] = c.FRACTIONS
    """Shares of the infinite cache's hits the minimum-capacity gauge reports."""
    time_profiles: tuple[str, ...] = ()
    """Time models (``flat``, ``h100``, ...) to project TTFT and break-even prompts under (the
    KV profile needs a compute shape for all but ``flat``)."""
    hardware: Mapping[str, Hardware] | None = None
    """The hardware table (default :data:`testbed.models.hardware.HARDWARE`)."""
    tiers: TierGrid | None = None
    """The (L1, L2) capacity pairs and tier policies of a what-if over tiers (``None``: none).
    Empty capacity tuples take :func:`.tiers.default_tier_grid`'s."""

    def __post_init__(self) -> None:
        problems = []
        if self.chunk_sizes is not None and (not self.chunk_sizes or min(self.chunk_sizes) < 1):
            problems.append(f"chunk_sizes must be positive, got {list(self.chunk_sizes)}")
        unknown = sorted(set(self.policies) - set(SIMULATED_POLICIES))
        if unknown or not self.policies:
            problems.append(
                f"policies must be some of {', '.join(SIMULATED_POLICIES)}, "
                f"got {list(self.policies)}"
            )
        if any(t < 0 for t in self.at_tokens):
            problems.append(f"at_tokens must be >= 0, got {list(self.at_tokens)}")
        if not 0.0 < self.sample_rate <= 1.0:
            problems.append(f"sample_rate must be in (0, 1], got {self.sample_rate}")
        if self.grid_points < 2 or self.policy_points < 1:
            problems.append("grid_points must be >= 2 and policy_points >= 1")
        if not all(0.0 < f <= 1.0 for f in self.fractions):
            problems.append(f"fractions must be in (0, 1], got {list(self.fractions)}")
        if problems:
            raise ValueError("invalid what-if options: " + "; ".join(problems))


def what_if_workload(spec: RunSpec, options: WhatIfOptions = WhatIfOptions()) -> WhatIf:
    """The what-if of the requests an oracle run of ``spec`` would see."""
    from testbed.analysis.whatif.sources import workload_traces

    sizes = options.chunk_sizes or (spec.chunk_size,)
    traces = workload_traces(spec, sizes)
    source = {
        "kind": "workload",
        "workload": spec.workload,
        "requests": spec.requests,
        "seed": spec.seed,
        "workload_params": spec.workload_params,
        "max_output_tokens": spec.max_output_tokens,
        "block_size": spec.block_size,
        "engine_blocks": spec.engine_blocks,
    }
    return analyze(traces, options, spec, source)


def what_if_run(run_dir: Path | str, options: WhatIfOptions = WhatIfOptions()) -> WhatIf:
    """The what-if of a run's recorded access stream, and the residual against the run."""
    from testbed.analysis.whatif.runlog import load_run_source

    run = load_run_source(run_dir)
    base = run.trace
    sizes = options.chunk_sizes or (run.spec.chunk_size,)
    traces = {size: base.at_chunk_size(size) for size in sizes}
    at = tuple(options.at_tokens)
    if run.capacity_tokens is not None:
        at += (run.capacity_tokens,)
    options = replace(options, at_tokens=at)
    source = {"kind": "run", "run_dir": str(run.path), "run_id": run.path.name}
    whatif = analyze(traces, options, run.spec, source)
    residual, per_request = _residual(run, base)
    return replace(whatif, meta={**whatif.meta, "run": residual}, run_requests=per_request)


def analyze(
    traces: Mapping[int, AccessTrace],
    options: WhatIfOptions,
    spec: RunSpec,
    source: dict[str, Any],
) -> WhatIf:
    """Curves, policy points, minimum capacities and reuse distributions of ``traces``."""
    bytes_per_token = spec.kv_profile.stored_bytes_per_token(spec.tp)
    parts = _Parts()
    for size, trace in sorted(traces.items()):
        _add_chunk_size(parts, size, trace, options, spec, bytes_per_token)
    reuse_table = pd.concat(parts.reuse, ignore_index=True)
    table = pd.DataFrame(parts.points)
    table["capacity_tokens"] = table["capacity_tokens"].astype("Int64")
    return WhatIf(
        meta=_meta(parts, reuse_table, options, spec, source, bytes_per_token),
        points=table,
        curves=pd.concat(parts.breakpoints, ignore_index=True),
        min_capacity=pd.DataFrame(parts.gauges),
        reuse=reuse_table,
        tiers=pd.concat(parts.tier_tables, ignore_index=True) if parts.tier_tables else None,
        lru=parts.curves,
    )


@dataclass
class _Parts:
    """What :func:`analyze` gathers, one chunk size after the other."""

    points: list[dict[str, Any]] = field(default_factory=list)
    """LRU and policy points (rows of ``WhatIf.points``)."""
    breakpoints: list[pd.DataFrame] = field(default_factory=list)
    gauges: list[dict[str, Any]] = field(default_factory=list)
    """Minimum capacities (rows of ``WhatIf.min_capacity``)."""
    reuse: list[pd.DataFrame] = field(default_factory=list)
    timings: list[dict[str, Any]] = field(default_factory=list)
    break_even: list[dict[str, Any]] = field(default_factory=list)
    curves: dict[int, c.LRUCurve] = field(default_factory=dict)
    tier_tables: list[pd.DataFrame] = field(default_factory=list)
    errors: dict[str, float] = field(default_factory=dict)
    """Per chunk size (as a string), the sampled curve's estimated error (sampled runs only)."""


def _add_chunk_size(
    parts: _Parts,
    size: int,
    trace: AccessTrace,
    options: WhatIfOptions,
    spec: RunSpec,
    bytes_per_token: int,
) -> None:
    """Adds to ``parts`` what ``trace`` (at chunk size ``size``) gives."""
    stack = stack_distances(trace, options.sample_rate, options.sample_seed)
    curve = c.lru_curve(trace, stack)
    parts.curves[size] = curve
    grid = c.capacity_grid(curve, options.grid_points, options.at_tokens)
    exact = options.sample_rate >= 1.0
    parts.points += [_row(size, "lru", p, exact) for p in curve.points(grid)]
    parts.breakpoints.append(curve.breakpoints())
    parts.points += _policy_rows(trace, curve, options)
    parts.gauges += _gauges(size, curve, options.fractions, bytes_per_token)
    parts.reuse.append(reuse_quantiles(trace, stack, bytes_per_token))
    if options.tiers is not None:
        tiers = default_tier_grid(options.tiers, stack, size)
        parts.tier_tables.append(
            tier_table(trace, stack, tiers, _tier_time(tiers, spec, size, options))
        )
    if options.time_profiles:
        models = time_models(
            options.time_profiles,
            spec.kv_profile,
            tp=spec.tp,
            chunk_size=size,
            hardware=options.hardware,
        )
        parts.timings += time_rows(trace, stack, models, [*sorted(set(options.at_tokens)), None])
        parts.break_even += break_even_rows(models, size)
    if not exact:
        parts.errors[str(size)] = c.estimated_sampling_error(curve, grid)


def _gauges(
    size: int, curve: c.LRUCurve, fractions: tuple[float, ...], bytes_per_token: int
) -> list[dict[str, Any]]:
    """Per fraction, the least capacity at which ``curve`` (chunk size ``size``) has that
    share of the infinite cache's hits, in tokens and bytes, and the hit rate there."""
    rows = []
    for fraction in fractions:
        tokens = curve.min_capacity_tokens(fraction)
        rows.append(
            {
                "chunk_size": size,
                "fraction": fraction,
                "capacity_tokens": tokens,
                "capacity_bytes": tokens * bytes_per_token,
                "token_hit_rate": curve.at(tokens).token_hit_rate,
            }
        )
    return rows


def _meta(
    parts: _Parts,
    reuse_table: pd.DataFrame,
    options: WhatIfOptions,
    spec: RunSpec,
    source: dict[str, Any],
    bytes_per_token: int,
) -> dict[str, Any]:
    """``whatif.json``'s metadata: the source, the KV, the requests, the options, the reuse
    summary and the projected times (``run``: ``None``, a run's residual is added later)."""
    first = next(iter(parts.curves.values()))
    return {
        "source": source,
        "profile": spec.kv_profile.name,
        "tp": spec.tp,
        "stored_bytes_per_token": bytes_per_token,
        "num_requests": first.num_requests,
        "prompt_tokens": first.prompt_tokens,
        "chunk_sizes": sorted(parts.curves),
        "policies": list(options.policies),
        "sample_rate": options.sample_rate,
        "sampling": None
        if options.sample_rate >= 1.0
        else {
            "seed": options.sample_seed,
            "estimated_max_error": parts.errors,
            "method": "SHARDS-style spatial sampling of the LRU stack; estimated_max_error is "
            "the largest 1-sigma token_hit_rate error over the grid (METRICS.md, what-if)",
        },
        "reuse": reuse_summary(reuse_table),
        "time": {"ttft": parts.timings, "break_even": parts.break_even}
        if options.time_profiles
        else None,
        "run": None,
    }


def _tier_time(
    grid: TierGrid, spec: RunSpec, chunk_size: int, options: WhatIfOptions
) -> TierTime | None:
    if grid.time_profile is None:
        return None
    (model,) = time_models(
        [grid.time_profile], spec.kv_profile, tp=spec.tp, chunk_size=chunk_size,
        hardware=options.hardware,
    ).values()  # fmt: skip
    return TierTime(model, tier_profile(grid.links), spec.kv_profile.bytes_per_token(spec.tp))


def policy_capacities(curve: c.LRUCurve, num_points: int, extra: tuple[int, ...]) -> list[int]:
    """``num_points`` capacities from 1% to 100% of all chunks (geometric), and ``extra``."""
    top = max(curve.num_distinct_keys, 1)
    chunks = np.unique(np.rint(np.geomspace(max(1, top / 100), top, num_points)).astype(np.int64))
    return sorted({int(k) * curve.chunk_size for k in chunks} | set(extra))


def _policy_rows(
    trace: AccessTrace, curve: c.LRUCurve, options: WhatIfOptions
) -> list[dict[str, Any]]:
    simulated = [p for p in options.policies if p != "lru"]
    if not simulated:
        return []
    keys = trace.request_key_arrays()  # each request's first lookup, walked as the oracle walks it
    unlimited = curve.at(None)
    rows = []
    for policy in simulated:
        for capacity in policy_capacities(curve, options.policy_points, options.at_tokens):
            hits = replay_flat(*keys, policy, capacity // trace.chunk_size).hit_chunks
            point = c.request_hits_point(trace, capacity, np.asarray(hits, dtype=np.int64))
            rows.append(_row(trace.chunk_size, policy, point, True))
        rows.append(_row(trace.chunk_size, policy, unlimited, options.sample_rate >= 1.0))
    return rows


def _row(chunk_size: int, policy: str, point: c.Point, exact: bool) -> dict[str, Any]:
    return {"chunk_size": chunk_size, "policy": policy, **point.row(), "exact": exact}


def _residual(run: RunSource, trace: AccessTrace) -> tuple[dict[str, Any], pd.DataFrame]:
    """The exact curve at the run's capacity and chunk size against the run's measured
    external hits, in total and per request."""
    capacity = run.capacity_tokens
    stack = stack_distances(trace)  # exact, whatever the options' sampling
    predicted = c.request_hit_tokens(trace, stack, capacity)
    requests = run.requests.assign(predicted_external_hit_tokens=predicted)
    requests["residual_tokens"] = (
        requests["predicted_external_hit_tokens"] - requests["external_hit_tokens"]
    )
    prompt = int(requests["prompt_tokens"].sum())
    measured = int(requests["external_hit_tokens"].sum())
    total = int(predicted.sum())
    summary = {
        "capacity_tokens": capacity,
        "chunk_size": trace.chunk_size,
        "policy": run.spec.policy,
        "prompt_tokens": prompt,
        "measured_external_hit_tokens": measured,
        "predicted_external_hit_tokens": total,
        "residual_tokens": total - measured,
        "residual_fraction_of_prompt_tokens": (total - measured) / prompt if prompt else 0.0,
        "requests_over": int((requests["residual_tokens"] > 0).sum()),
        "requests_under": int((requests["residual_tokens"] < 0).sum()),
    }
    return summary, requests
