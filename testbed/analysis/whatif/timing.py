"""What the hits are worth in time: projected TTFT with and without the cache, compute saved,
break-even prompt length, under the time models of :mod:`testbed.models.time_model`.

Each request is projected alone, its whole prefill in one step (no batching, no queueing, no
chunked prefill): the per-request cost of a miss, not a serving simulation. A workload's hit
``H_r`` is all loaded; a run keeps its engine hit ``E_r`` in both projections and loads
``X_r``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from testbed.analysis.whatif.curves import request_hit_tokens
from testbed.analysis.whatif.stack import StackResult
from testbed.models.access_trace import AccessTrace
from testbed.models.hardware import Hardware
from testbed.models.profiles import KVProfile
from testbed.models.projections import (
    break_even_prompt_tokens,
    compute_saved_fraction,
    ttft_summary,
)
from testbed.models.time_model import RooflineTimeModel, TimeModel, make_time_model


def time_models(
    names: Sequence[str],
    profile: KVProfile,
    *,
    tp: int,
    chunk_size: int,
    hardware: Mapping[str, Hardware] | None = None,
) -> dict[str, TimeModel]:
    """The named time models for one model profile and chunk size."""
    return {
        name: make_time_model(name, profile, tp=tp, chunk_size=chunk_size, hardware=hardware)
        for name in names
    }


def time_rows(
    trace: AccessTrace,
    stack: StackResult,
    models: Mapping[str, TimeModel],
    capacities_tokens: Sequence[int | None],
) -> list[dict[str, Any]]:
    """Per time model and capacity: TTFT mean/p50/p99 with and without the cache (ms) and the
    share of prefill FLOPs saved (roofline models)."""
    rows = []
    for capacity in capacities_tokens:
        loaded = request_hit_tokens(trace, stack, capacity)
        for name, model in models.items():
            row: dict[str, Any] = {
                "chunk_size": trace.chunk_size,
                "time_profile": name,
                "capacity_tokens": capacity,
                **ttft_summary(model, trace.prompt_tokens, loaded, trace.engine_hit_tokens),
            }
            if isinstance(model, RooflineTimeModel):
                row["compute_saved_fraction"] = compute_saved_fraction(
                    model, trace.prompt_tokens, loaded, trace.engine_hit_tokens
                )
            rows.append(row)
    return rows


def break_even_rows(models: Mapping[str, TimeModel], chunk_size: int) -> list[dict[str, Any]]:
    """Per time model: the shortest prompt from which a full hit always pays."""
    return [
        {
            "chunk_size": chunk_size,
            "time_profile": name,
            "break_even_prompt_tokens": break_even_prompt_tokens(model, chunk_size),
        }
        for name, model in models.items()
    ]
