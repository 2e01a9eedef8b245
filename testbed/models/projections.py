"""Per request: projected TTFT with and without the cache, compute saved, break-even length.

Projections of one request alone under a time model (:mod:`testbed.models.time_model`):
:func:`request_ttft_s` (its prefill in one step, the engine's own hit and the loaded tokens not
computed), :func:`break_even_prompt_tokens` (the shortest prompt from which on a full hit pays),
:func:`compute_saved_fraction` and :func:`ttft_summary`. METRICS.md ("Time what-if") states the
formulas and their limits.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from testbed.models.hardware import HARDWARE, Hardware
from testbed.models.profiles import KVProfile
from testbed.models.time_model import RooflineTimeModel, TimeModel, make_time_model


def request_ttft_s(
    model: TimeModel,
    prompt_tokens: np.ndarray | Sequence[int],
    loaded_tokens: np.ndarray | Sequence[int],
    engine_hit_tokens: np.ndarray | Sequence[int] | None = None,
) -> np.ndarray:
    """Per request, its prefill alone in one step: the first ``engine_hit_tokens`` already in
    the engine's KV, the next ``loaded_tokens`` loaded from the cache, the rest computed (the
    last prompt token always: the engine computes it itself)."""
    prompts = np.asarray(prompt_tokens, dtype=np.int64)
    engine = (
        np.zeros_like(prompts)
        if engine_hit_tokens is None
        else np.clip(np.asarray(engine_hit_tokens, dtype=np.int64), 0, np.maximum(prompts - 1, 0))
    )
    loaded = np.clip(
        np.asarray(loaded_tokens, dtype=np.int64), 0, np.maximum(prompts - 1 - engine, 0)
    )
    context = engine + loaded
    return model.isolated_s(prompts - context, context, loaded)


def break_even_prompt_tokens(
    model: TimeModel, chunk_size: int, max_prompt_tokens: int = 1 << 20
) -> int | None:
    """The shortest prompt from which on a full hit (every complete chunk before the last
    token) always projects a shorter TTFT than recomputing; ``None`` if none up to
    ``max_prompt_tokens``."""
    prompts = np.arange(chunk_size + 1, max_prompt_tokens + 1, dtype=np.int64)
    if not len(prompts):
        return None
    hits = (prompts - 1) // chunk_size * chunk_size
    pays = request_ttft_s(model, prompts, hits) < request_ttft_s(model, prompts, 0 * hits)
    if not pays[-1]:
        return None
    losing = np.flatnonzero(~pays)
    return int(prompts[losing[-1] + 1]) if len(losing) else int(prompts[0])


def break_even_table(
    profile: KVProfile,
    hardware_names: Sequence[str],
    chunk_sizes: Sequence[int],
    *,
    tp: int = 1,
    hardware: Mapping[str, Hardware] | None = None,
) -> list[dict[str, object]]:
    """Rows ``{hardware, chunk_size, break_even_prompt_tokens, ...}`` for a model profile."""
    rows: list[dict[str, object]] = []
    for name in hardware_names:
        for chunk_size in chunk_sizes:
            model = make_time_model(name, profile, tp=tp, chunk_size=chunk_size, hardware=hardware)
            tokens = break_even_prompt_tokens(model, chunk_size)
            row: dict[str, object] = {
                "hardware": name,
                "basis": _basis((HARDWARE if hardware is None else hardware).get(name)),
                "profile": profile.name,
                "tp": tp,
                "chunk_size": chunk_size,
                "break_even_prompt_tokens": tokens,
            }
            if tokens is not None:
                hit = (tokens - 1) // chunk_size * chunk_size
                row["ttft_ms_without_cache"] = float(request_ttft_s(model, [tokens], [0])[0]) * 1e3
                row["ttft_ms_with_cache"] = float(request_ttft_s(model, [tokens], [hit])[0]) * 1e3
            rows.append(row)
    return rows


def _basis(hardware: Hardware | None) -> str:
    """Whether a profile's projections rest on measured figures or on the datasheet alone."""
    return "measured" if hardware is not None and hardware.measured else "datasheet"


def compute_saved_fraction(
    model: RooflineTimeModel,
    prompt_tokens: np.ndarray,
    loaded_tokens: np.ndarray,
    engine_hit_tokens: np.ndarray | None = None,
) -> float:
    """Share of the prefill FLOPs (engine hits already excluded) that the loads avoid."""
    prompts = np.asarray(prompt_tokens, dtype=np.float64)
    engine = (
        np.zeros_like(prompts)
        if engine_hit_tokens is None
        else np.asarray(engine_hit_tokens, dtype=np.float64)
    )
    loaded = np.clip(
        np.asarray(loaded_tokens, dtype=np.float64), 0, np.maximum(prompts - 1 - engine, 0)
    )
    total = model.flops(prompts - engine, engine)
    return (
        0.0 if total == 0 else 1.0 - model.flops(prompts - engine - loaded, engine + loaded) / total
    )


def ttft_summary(
    model: TimeModel,
    prompt_tokens: np.ndarray,
    loaded_tokens: np.ndarray,
    engine_hit_tokens: np.ndarray | None = None,
) -> dict[str, float]:
    """Mean, p50 and p99 projected TTFT (ms) with the loads and without them (the engine's
    own hits kept in both)."""
    prompts = np.asarray(prompt_tokens, dtype=np.int64)
    summary = {}
    for label, loaded in (("with_cache", loaded_tokens), ("without_cache", np.zeros_like(prompts))):
        values = request_ttft_s(model, prompts, np.asarray(loaded), engine_hit_tokens) * 1e3
        empty = not len(values)
        summary[f"ttft_ms_mean_{label}"] = math.nan if empty else float(values.mean())
        for q in (50, 99):
            summary[f"ttft_ms_p{q}_{label}"] = (
                math.nan if empty else float(np.percentile(values, q))
            )
    return summary
