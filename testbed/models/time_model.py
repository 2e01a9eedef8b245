"""Projected step time: what a scheduler step would cost on named hardware.

A *time model* maps one engine step — per request, the tokens it computes, the tokens already
in its KV (context) and the tokens loaded from the external cache before it computes — to
seconds. Two kinds, behind one method (:meth:`TimeModel.step_s`):

- ``flat``: today's replay clock, ``step_overhead_s + token_s x sum(new tokens)`` (5 ms and
  40 µs); loads are free. Any KV profile.
- a **roofline** per hardware profile (H100, H200, A100, L40S, or one you add):

  compute   = (2 N_active x new + A x pairs) / (peak_flops x compute_efficiency) / tp
  memory    = (2 N / tp + (context + new) x kv_bytes_per_token_per_rank) / (hbm x memory_eff)
  gpu       = max(compute, memory)
  load      = loaded x kv_bytes_per_token_per_rank / (link x link_efficiency)
              + load_latency_s (per request that loads) + chunk_overhead_s x chunks loaded
  step      = step_overhead_s + gpu + load          (loads serial; overlap_loads: max(gpu, load))

  with ``pairs = new x context + new (new + 1) / 2`` (causal attention of the new tokens over
  the context and each other) and ``A = 2 x layers x query_heads x (qk_dim + v_dim)`` FLOPs per
  (token, context token) pair. Each TP rank loads its own KV shard over its own link.

Figures are from the vendors' datasheets (dense bf16 tensor FLOP/s, i.e. half the "with
sparsity" number; HBM bandwidth; host link per direction, half the bidirectional PCIe figure).
The efficiency factors and fixed costs are assumptions until a GPU run calibrates them: a
profile's ``measured_*`` figures (fitted by :mod:`testbed.models.calibration` from prefill and
KV-load times measured on the device, ``scripts/gpu_check.sh``) replace the compute
efficiency, the load rate and the load latency when present, and every projection, break-even
lengths included, follows them (:meth:`Hardware.datasheet` gives the profile without them). Add
or override profiles in a TOML file (:func:`load_hardware`). METRICS.md ("Time what-if") states
the formulas and their limits.

The replay engine calls :meth:`TimeModel.step_s` once per scheduler step with the scheduled
requests' counts; :func:`request_ttft_s` projects one request alone.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from testbed.models.profiles import DTYPE_BYTES, KVProfile


@dataclass(frozen=True)
class Hardware:
    """One accelerator's published figures and the model's assumptions about them."""

    name: str
    peak_flops: float
    """Dense bf16 tensor FLOP/s (datasheet)."""
    hbm_bytes_per_s: float
    """Device memory bandwidth (datasheet)."""
    link_bytes_per_s: float
    """Host-device link, one direction (datasheet; half the bidirectional figure)."""
    compute_efficiency: float = 0.5
    """Share of ``peak_flops`` prefill reaches (model FLOPs utilisation; an assumption)."""
    memory_efficiency: float = 0.8
    link_efficiency: float = 0.8
    step_overhead_s: float = 0.0
    """Fixed cost of a step (launches, scheduling)."""
    load_latency_s: float = 0.0
    """Fixed cost of one request's load (lookup and retrieve round trip)."""
    chunk_overhead_s: float = 0.0
    """Fixed cost per chunk loaded (per-object transfer setup)."""
    overlap_loads: bool = False
    """Whether loads overlap the forward pass (layer-wise pipelining) instead of preceding it."""
    source: str = ""
    """Where the figures come from."""
    measured_compute_efficiency: float | None = None
    """Share of ``peak_flops`` a prefill reached on this hardware, fitted to measured prefill
    times (``testbed.models.calibration``); replaces ``compute_efficiency`` when given."""
    measured_load_bytes_per_s: float | None = None
    """KV load rate measured from the cache server's default pool (pinned host memory) into
    the GPU; replaces ``link_bytes_per_s × link_efficiency`` when given."""
    measured_load_latency_s: float | None = None
    """Fixed cost of one load, fitted with the rate; replaces ``load_latency_s`` when given."""
    measured_prefill_ms: tuple[tuple[int, float], ...] | None = None
    """The measured points ``(prompt tokens, prefill ms)`` the fit came from (the record)."""
    measured_load_ms: tuple[tuple[int, float], ...] | None = None
    """The measured points ``(tokens, load ms)`` the load fit came from."""
    measured_source: str = ""
    """Where, when and with what command the measured figures were taken."""

    def __post_init__(self) -> None:
        problems = [
            f"{f} must be positive"
            for f in ("peak_flops", "hbm_bytes_per_s", "link_bytes_per_s")
            if not getattr(self, f) > 0
        ]
        problems += [
            f"{f} must be in (0, 1]"
            for f in ("compute_efficiency", "memory_efficiency", "link_efficiency")
            if not 0 < getattr(self, f) <= 1
        ]
        problems += [
            f"{f} must be >= 0"
            for f in ("step_overhead_s", "load_latency_s", "chunk_overhead_s")
            if not getattr(self, f) >= 0
        ]
        if self.measured_compute_efficiency is not None and not (
            0 < self.measured_compute_efficiency <= 1
        ):
            problems.append("measured_compute_efficiency must be in (0, 1]")
        if self.measured_load_bytes_per_s is not None and not self.measured_load_bytes_per_s > 0:
            problems.append("measured_load_bytes_per_s must be positive")
        if problems:
            raise ValueError(f"hardware profile {self.name!r}: " + "; ".join(problems))

    @property
    def measured(self) -> bool:
        """Whether measured figures replace the datasheet's assumptions."""
        return self.measured_compute_efficiency is not None or (
            self.measured_load_bytes_per_s is not None
        )

    @property
    def effective_compute_efficiency(self) -> float:
        return self.measured_compute_efficiency or self.compute_efficiency

    @property
    def effective_load_bytes_per_s(self) -> float:
        """KV load rate: measured, else the datasheet link at ``link_efficiency``."""
        return self.measured_load_bytes_per_s or self.link_bytes_per_s * self.link_efficiency

    @property
    def effective_load_latency_s(self) -> float:
        if self.measured_load_latency_s is None:
            return self.load_latency_s
        return self.measured_load_latency_s

    def datasheet(self) -> Hardware:
        """This profile without its measured figures (to compare both bases)."""
        return replace(
            self,
            measured_compute_efficiency=None,
            measured_load_bytes_per_s=None,
            measured_load_latency_s=None,
        )


_GB = 1e9
HARDWARE: dict[str, Hardware] = {
    h.name: h
    for h in (
        Hardware(
            "h100",
            peak_flops=989.4e12,
            hbm_bytes_per_s=3350 * _GB,
            link_bytes_per_s=64 * _GB,
            source="NVIDIA H100 SXM5 datasheet: 1,979 TFLOPS bf16 with sparsity, HBM3 3.35 TB/s, "
            "PCIe Gen5 128 GB/s (bidirectional)",
        ),
        Hardware(
            "h200",
            peak_flops=989.4e12,
            hbm_bytes_per_s=4800 * _GB,
            link_bytes_per_s=64 * _GB,
            source="NVIDIA H200 SXM datasheet: 1,979 TFLOPS bf16 with sparsity, HBM3e 4.8 TB/s, "
            "PCIe Gen5 128 GB/s (bidirectional)",
            # Measured figures: None until a device run fills them (docs/gpu.md: `bash
            # scripts/gpu_check.sh` writes h200_calibration.toml; copy its values here).
            measured_compute_efficiency=None,
            measured_load_bytes_per_s=None,
            measured_load_latency_s=None,
            measured_prefill_ms=None,
            measured_load_ms=None,
        ),
        Hardware(
            "a100",
            peak_flops=312e12,
            hbm_bytes_per_s=2039 * _GB,
            link_bytes_per_s=32 * _GB,
            source="NVIDIA A100 80GB SXM datasheet: 312 TFLOPS bf16 dense, HBM2e 2,039 GB/s, "
            "PCIe Gen4 64 GB/s (bidirectional)",
        ),
        Hardware(
            "l40s",
            peak_flops=362.05e12,
            hbm_bytes_per_s=864 * _GB,
            link_bytes_per_s=32 * _GB,
            source="NVIDIA L40S datasheet: 362.05 TFLOPS bf16 dense (733 with sparsity), GDDR6 "
            "864 GB/s, PCIe Gen4 x16 64 GB/s (bidirectional)",
        ),
    )
}
"""Named hardware profiles (extend with :func:`load_hardware`)."""

FLAT = "flat"
FLAT_STEP_OVERHEAD_S = 5e-3
FLAT_TOKEN_S = 40e-6


class TimeModel(Protocol):
    """Seconds of one engine step."""

    @property
    def name(self) -> str:
        """The profile's name (``flat``, ``h100``, ...)."""
        ...

    def step_s(
        self,
        num_new_tokens: Sequence[int],
        num_context_tokens: Sequence[int],
        num_loaded_tokens: Sequence[int] | None = None,
    ) -> float:
        """One step of the scheduled requests, element ``i`` being request ``i``'s
        ``num_new_tokens`` (computed this step: a prefill chunk, or 1 when decoding),
        ``num_context_tokens`` (already in its KV before them: computed earlier, vLLM's prefix
        hit, or loaded) and ``num_loaded_tokens`` (loaded from the external cache for this
        step, part of the context; ``None``: none)."""
        ...

    def isolated_s(
        self,
        num_new_tokens: np.ndarray,
        num_context_tokens: np.ndarray,
        num_loaded_tokens: np.ndarray,
    ) -> np.ndarray:
        """Element-wise: the step time of a step that holds request ``i`` alone."""
        ...


@dataclass(frozen=True)
class FlatTimeModel:
    """The replay's historical clock: ``step_overhead_s + token_s x sum(new)``; loads free."""

    step_overhead_s: float = FLAT_STEP_OVERHEAD_S
    token_s: float = FLAT_TOKEN_S
    name: str = FLAT

    def step_s(
        self,
        num_new_tokens: Sequence[int],
        num_context_tokens: Sequence[int],
        num_loaded_tokens: Sequence[int] | None = None,
    ) -> float:
        return self.step_overhead_s + self.token_s * float(np.sum(num_new_tokens))

    def isolated_s(
        self,
        num_new_tokens: np.ndarray,
        num_context_tokens: np.ndarray,
        num_loaded_tokens: np.ndarray,
    ) -> np.ndarray:
        return self.step_overhead_s + self.token_s * np.asarray(num_new_tokens, dtype=np.float64)


@dataclass(frozen=True)
class RooflineTimeModel:
    """The roofline of the module docstring for one model on ``tp`` GPUs of one kind."""

    hardware: Hardware
    profile: KVProfile
    tp: int = 1
    chunk_size: int = 256
    """Tokens per cached chunk (for ``chunk_overhead_s``)."""

    def __post_init__(self) -> None:
        if not self.profile.has_compute_shape:
            raise ValueError(
                f"KV profile {self.profile.name!r} has no compute shape (parameters, query "
                f"heads): use a model profile such as llama3-8b, or the {FLAT!r} time model"
            )
        if self.tp < 1 or self.chunk_size < 1:
            raise ValueError("tp and chunk_size must be positive")
        self.profile.heads_per_rank(self.tp)

    @property
    def name(self) -> str:
        return self.hardware.name

    @property
    def linear_flops_per_token(self) -> float:
        p = self.profile
        return 2.0 * float(p.num_active_params or p.num_params or 0)

    @property
    def attention_flops_per_pair(self) -> float:
        """FLOPs of one (new token, context token) pair over all layers: QK^T and AV."""
        p = self.profile
        qk = p.qk_head_dim or p.head_dim
        v = p.v_head_dim or p.head_dim
        return 2.0 * p.num_layers * float(p.num_query_heads or 0) * (qk + v)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one rank holds (and loads) per token."""
        return self.profile.bytes_per_token(self.tp)

    def flops(self, num_new_tokens: np.ndarray, num_context_tokens: np.ndarray) -> float:
        """Forward FLOPs of a step, all ranks together."""
        new = np.asarray(num_new_tokens, dtype=np.float64)
        context = np.asarray(num_context_tokens, dtype=np.float64)
        pairs = new * context + new * (new + 1) / 2
        return float(
            self.linear_flops_per_token * new.sum() + self.attention_flops_per_pair * pairs.sum()
        )

    def step_s(
        self,
        num_new_tokens: Sequence[int],
        num_context_tokens: Sequence[int],
        num_loaded_tokens: Sequence[int] | None = None,
    ) -> float:
        new = np.asarray(num_new_tokens, dtype=np.float64)
        context = np.asarray(num_context_tokens, dtype=np.float64)
        if new.shape != context.shape:
            raise ValueError("num_new_tokens and num_context_tokens need one entry per request")
        loaded = (
            np.zeros_like(new)
            if num_loaded_tokens is None
            else np.asarray(num_loaded_tokens, dtype=np.float64)
        )
        if not len(new):
            return self.hardware.step_overhead_s + float(self._load_s(loaded).sum())
        compute_s = self.flops(new, context) / self._flops_rate
        memory_s = (self._weight_bytes + (context + new).sum() * self.kv_bytes_per_token) / (
            self._memory_rate
        )
        return self._combine(max(compute_s, memory_s), float(self._load_s(loaded).sum()))

    def isolated_s(
        self,
        num_new_tokens: np.ndarray,
        num_context_tokens: np.ndarray,
        num_loaded_tokens: np.ndarray,
    ) -> np.ndarray:
        new = np.asarray(num_new_tokens, dtype=np.float64)
        context = np.asarray(num_context_tokens, dtype=np.float64)
        pairs = new * context + new * (new + 1) / 2
        compute_s = (
            self.linear_flops_per_token * new + self.attention_flops_per_pair * pairs
        ) / self._flops_rate
        memory_s = (self._weight_bytes + (context + new) * self.kv_bytes_per_token) / (
            self._memory_rate
        )
        load_s = self._load_s(np.asarray(num_loaded_tokens, dtype=np.float64))
        return np.asarray(self._combine(np.maximum(compute_s, memory_s), load_s))

    @property
    def _flops_rate(self) -> float:
        """Achieved FLOP/s of the ``tp`` GPUs together."""
        return self.hardware.peak_flops * self.hardware.effective_compute_efficiency * self.tp

    @property
    def _memory_rate(self) -> float:
        return self.hardware.hbm_bytes_per_s * self.hardware.memory_efficiency

    @property
    def _weight_bytes(self) -> float:
        """Weights one rank reads per step."""
        return DTYPE_BYTES * float(self.profile.num_params or 0) / self.tp

    def _load_s(self, loaded: np.ndarray) -> np.ndarray:
        """Per request: its load's transfer time and fixed costs (0 without a load)."""
        h = self.hardware
        transfer_s = loaded * self.kv_bytes_per_token / h.effective_load_bytes_per_s
        fixed_s = h.effective_load_latency_s + h.chunk_overhead_s * np.ceil(
            loaded / self.chunk_size
        )
        return np.where(loaded > 0, transfer_s + fixed_s, 0.0)

    def _combine(self, gpu_s: Any, load_s: Any) -> Any:
        """Step time from the GPU and load times (floats or arrays alike)."""
        h = self.hardware
        body = np.maximum(gpu_s, load_s) if h.overlap_loads else gpu_s + load_s
        return h.step_overhead_s + body


def make_time_model(
    name: str,
    profile: KVProfile,
    *,
    tp: int = 1,
    chunk_size: int = 256,
    hardware: Mapping[str, Hardware] | None = None,
) -> TimeModel:
    """The time model called ``name``: ``flat`` or a hardware profile of ``hardware``
    (default :data:`HARDWARE`)."""
    if name == FLAT:
        return FlatTimeModel()
    table = HARDWARE if hardware is None else hardware
    if name not in table:
        raise ValueError(f"unknown time profile {name!r}; choose one of {FLAT}, {', '.join(table)}")
    return RooflineTimeModel(table[name], profile, tp=tp, chunk_size=chunk_size)


def load_hardware(path: Path | str) -> dict[str, Hardware]:
    """:data:`HARDWARE` extended (or overridden) by a TOML file of tables, one per profile::

        [b200]
        peak_flops = 2.25e15
        hbm_bytes_per_s = 8e12
        link_bytes_per_s = 64e9
        compute_efficiency = 0.55

    A table named like a built-in profile overrides only the keys it gives.
    """
    document = tomllib.loads(Path(path).read_text())
    known = {f.name for f in fields(Hardware)} - {"name"}
    table = dict(HARDWARE)
    for name, values in document.items():
        if not isinstance(values, dict):
            raise ValueError(f"{path}: [{name}] must be a table of hardware figures")
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"{path}: [{name}] has unknown keys {unknown}; valid keys: {sorted(known)}"
            )
        base = table.get(name)
        merged = {**({f.name: getattr(base, f.name) for f in fields(Hardware)} if base else {})}
        merged.update(values, name=name)
        for key in ("measured_prefill_ms", "measured_load_ms"):
            if merged.get(key) is not None:
                merged[key] = tuple(tuple(point) for point in merged[key])
        try:
            table[name] = Hardware(**merged)
        except TypeError as exc:
            raise ValueError(f"{path}: [{name}]: {exc}") from None
    return table


# -------------------------------------------------------------------------------------------
# Per request: TTFT with and without the cache, break-even prompt length
# -------------------------------------------------------------------------------------------


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
