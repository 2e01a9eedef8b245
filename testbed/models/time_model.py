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

The hardware figures and their measured replacements are :mod:`testbed.models.hardware`'s;
every projection, break-even lengths included, follows the measured ones when a profile has
them. METRICS.md ("Time what-if") states the formulas and their limits.

The replay engine calls :meth:`TimeModel.step_s` once per scheduler step with the scheduled
requests' counts; :mod:`testbed.models.projections` projects one request alone.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from testbed.models.hardware import HARDWARE, Hardware
from testbed.models.profiles import DTYPE_BYTES, KVProfile

FLAT = "flat"
FLAT_STEP_OVERHEAD_S = 5e-3
FLAT_TOKEN_S = 40e-6


class TimeModel(ABC):
    """Seconds of one engine step: :meth:`step_s` and :meth:`isolated_s` take the counts as
    float arrays to the model's own :meth:`_step_s` and :meth:`_isolated_s`; :meth:`step_s`
    first offers them, as they came, to :meth:`_integer_step_s`, which a model may give where
    Python numbers reach the same float to the bit, faster."""

    @property
    @abstractmethod
    def name(self) -> str:
        """The profile's name (``flat``, ``h100``, ...)."""

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
        if len(num_new_tokens) != len(num_context_tokens):
            raise ValueError("num_new_tokens and num_context_tokens need one entry per request")
        if num_loaded_tokens is not None and len(num_loaded_tokens) != len(num_new_tokens):
            raise ValueError("num_loaded_tokens needs one entry per request")
        if isinstance(num_new_tokens, list | tuple):  # arrays go to the arrays
            given = () if num_loaded_tokens is None else num_loaded_tokens
            exact = self._integer_step_s(num_new_tokens, num_context_tokens, given)
            if exact is not None:
                return exact
        new = np.asarray(num_new_tokens, dtype=np.float64)
        context = np.asarray(num_context_tokens, dtype=np.float64)
        loaded = (
            np.zeros_like(new)
            if num_loaded_tokens is None
            else np.asarray(num_loaded_tokens, dtype=np.float64)
        )
        return self._step_s(new, context, loaded)

    def isolated_s(
        self,
        num_new_tokens: np.ndarray,
        num_context_tokens: np.ndarray,
        num_loaded_tokens: np.ndarray,
    ) -> np.ndarray:
        """Element-wise: the step time of a step that holds request ``i`` alone."""
        return self._isolated_s(
            np.asarray(num_new_tokens, dtype=np.float64),
            np.asarray(num_context_tokens, dtype=np.float64),
            np.asarray(num_loaded_tokens, dtype=np.float64),
        )

    def _integer_step_s(
        self, new: Sequence[int], context: Sequence[int], loaded: Sequence[int]
    ) -> float | None:
        """:meth:`_step_s` computed on Python numbers, or ``None`` where it cannot be had to
        the bit (the replay calls :meth:`step_s` once a scheduler step, with a few requests:
        NumPy's fixed cost per call is most of the time). A model may give it when its step
        depends on the counts only through sums of integers, which are exact in any order."""
        return None

    @abstractmethod
    def _step_s(self, new: np.ndarray, context: np.ndarray, loaded: np.ndarray) -> float: ...

    @abstractmethod
    def _isolated_s(
        self, new: np.ndarray, context: np.ndarray, loaded: np.ndarray
    ) -> np.ndarray: ...


@dataclass(frozen=True)
class FlatTimeModel(TimeModel):
    """The replay's historical clock: ``step_overhead_s + token_s x sum(new)``; loads free."""

    step_overhead_s: float = FLAT_STEP_OVERHEAD_S
    token_s: float = FLAT_TOKEN_S
    name: str = FLAT

    def _step_s(self, new: np.ndarray, context: np.ndarray, loaded: np.ndarray) -> float:
        return self.step_overhead_s + self.token_s * float(np.sum(new))

    def _integer_step_s(
        self, new: Sequence[int], context: Sequence[int], loaded: Sequence[int]
    ) -> float | None:
        if not _all_int(new):
            return None
        return self.step_overhead_s + self.token_s * float(sum(new))

    def _isolated_s(self, new: np.ndarray, context: np.ndarray, loaded: np.ndarray) -> np.ndarray:
        return self.step_overhead_s + self.token_s * new


@dataclass(frozen=True)
class RooflineTimeModel(TimeModel):
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

    @cached_property
    def linear_flops_per_token(self) -> float:
        p = self.profile
        return 2.0 * float(p.num_active_params or p.num_params or 0)

    @cached_property
    def attention_flops_per_pair(self) -> float:
        """FLOPs of one (new token, context token) pair over all layers: QK^T and AV."""
        p = self.profile
        qk = p.qk_head_dim or p.head_dim
        v = p.v_head_dim or p.head_dim
        return 2.0 * p.num_layers * float(p.num_query_heads or 0) * (qk + v)

    @cached_property
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

    def _step_s(self, new: np.ndarray, context: np.ndarray, loaded: np.ndarray) -> float:
        if not len(new):
            return self.hardware.step_overhead_s + float(self._load_s(loaded).sum())
        compute_s = self.flops(new, context) / self._flops_rate
        memory_s = (self._weight_bytes + (context + new).sum() * self.kv_bytes_per_token) / (
            self._memory_rate
        )
        return self._combine(max(compute_s, memory_s), float(self._load_s(loaded).sum()))

    def _integer_step_s(
        self, new: Sequence[int], context: Sequence[int], loaded: Sequence[int]
    ) -> float | None:
        """Integer counts, at most one request loading: the sums of :meth:`_step_s` are exact
        integers (below 2**53), and the one load is the load sum; every other operation is the
        same IEEE operation on a Python float as on a NumPy one."""
        loads = [tokens for tokens in loaded if tokens > 0]  # the arrays' mask
        if len(loads) > 1 or not (_all_int(new) and _all_int(context) and _all_int(loads)):
            return None
        load_s = self._one_load_s(loads[0]) if loads else 0.0
        if not new:
            return self.hardware.step_overhead_s + load_s
        new_sum = sum(new)
        pairs = sum(n * c + n * (n + 1) // 2 for n, c in zip(new, context, strict=True))
        if pairs >= _EXACT:
            return None
        linear = self.linear_flops_per_token * float(new_sum)
        flops = linear + self.attention_flops_per_pair * float(pairs)
        compute_s = flops / self._flops_rate
        kv_tokens = float(sum(context) + new_sum)
        memory_s = (self._weight_bytes + kv_tokens * self.kv_bytes_per_token) / self._memory_rate
        return float(self._combine(max(compute_s, memory_s), load_s))

    def _one_load_s(self, tokens: int) -> float:
        """:meth:`_load_s` of one request loading ``tokens`` (> 0), on Python floats."""
        h = self.hardware
        transfer_s = float(tokens) * self.kv_bytes_per_token / h.effective_load_bytes_per_s
        fixed_s = h.effective_load_latency_s + h.chunk_overhead_s * math.ceil(
            float(tokens) / self.chunk_size
        )
        return transfer_s + fixed_s

    def _isolated_s(self, new: np.ndarray, context: np.ndarray, loaded: np.ndarray) -> np.ndarray:
        pairs = new * context + new * (new + 1) / 2
        compute_s = (
            self.linear_flops_per_token * new + self.attention_flops_per_pair * pairs
        ) / self._flops_rate
        memory_s = (self._weight_bytes + (context + new) * self.kv_bytes_per_token) / (
            self._memory_rate
        )
        load_s = self._load_s(loaded)
        return np.asarray(self._combine(np.maximum(compute_s, memory_s), load_s))

    @cached_property
    def _flops_rate(self) -> float:
        """Achieved FLOP/s of the ``tp`` GPUs together."""
        return self.hardware.peak_flops * self.hardware.effective_compute_efficiency * self.tp

    @cached_property
    def _memory_rate(self) -> float:
        return self.hardware.hbm_bytes_per_s * self.hardware.memory_efficiency

    @cached_property
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


_EXACT = 2**53
"""Below it, a float holds every integer, so sums of them are exact in any order."""


def _all_int(values: Sequence[Any]) -> bool:
    return all(type(value) is int for value in values)


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
