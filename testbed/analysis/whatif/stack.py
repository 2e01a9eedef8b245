"""Mattson's stack algorithm with prefix semantics: LRU at every capacity in one pass.

Under LRU with forced insertion, a cache of ``c`` keys holds exactly the ``c`` most recently
referenced keys (the inclusion property). So the *stack distance* of a query, 1 + the number of
distinct keys referenced since its key's last reference, says at once for every capacity
whether the key is cached: it is iff ``distance <= c``. A lookup hits a *prefix*: its chunk
``m`` counts at capacity ``c`` iff chunks ``0..m`` are all cached, i.e. iff the running maximum
``D_m = max(d_0..d_m)`` is ``<= c``. A query's distance is taken before the step's own
references, so a request never hits on itself.

Distances are counted with a Fenwick tree over reference order. Every reference keeps its
key's last position exactly; the tree counts the distinct keys since a position. Because a
key's distance only grows with the age of its last reference, ``D_m`` is the distance of the
oldest last reference in the prefix, ``tau_m``.

**Sampling** (``sample_rate < 1``, SHARDS-style, Waldspurger et al., FAST'15): only a
hash-selected share of the keys enters the tree, so the count of distinct keys since
``tau_m`` is estimated as (sampled keys since ``tau_m``) x (distinct keys so far / sampled
keys so far). Recency positions stay exact for every key (one array write per reference), so
the prefix rule is applied exactly; only the distance axis is estimated. Memory: O(keys +
sampled references) instead of O(keys + references). The error is measured, not assumed
(``python -m testbed.bench.whatif``; at 1% on the Mooncake conversation trace see docs/analysis.md).

The kernel is compiled with numba when it is importable (the ``lab`` extra installs it);
without it the same code runs as plain Python, correct but roughly 100x slower, with a warning.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from testbed.models.access_trace import AccessTrace

COLD = np.int64(2**62)
"""Distance of a query whose key was never referenced before (a miss at every capacity)."""

try:
    from numba import njit as _njit
except ImportError:  # pragma: no cover - numba comes with the lab extra
    _njit = None

NUMBA = _njit is not None
"""Whether the kernels are compiled (numba importable)."""

EXACT_WINDOW_SAMPLES = 256
"""Sampling keeps an exact count over the latest ``EXACT_WINDOW_SAMPLES / sample_rate``
references: short distances, which a sample of a few keys cannot estimate, stay exact."""


def _compiled(function: Callable[..., Any]) -> Callable[..., Any]:
    if _njit is None:
        return function
    return _njit(cache=True, nogil=True)(function)


@dataclass(frozen=True, eq=False)
class StackResult:
    """Per query of a trace: its own distance, its prefix's distance and its reuse interval."""

    distances: np.ndarray
    """int64: stack distance of the query's own key in keys (:data:`COLD` if never seen)."""
    prefix_distances: np.ndarray
    """int64: ``D_m``, the running maximum over the lookup so far (non-decreasing per step)."""
    intervals_s: np.ndarray
    """float64: seconds since the key's last reference (NaN if never seen)."""
    sample_rate: float
    num_distinct_keys: int
    """Distinct keys referenced over the whole trace (the infinite cache's size)."""
    exact_window_keys: int
    """Sampled: about how many keys the exact window spans (its references x distinct keys
    per reference); distances up to it are exact. Exact mode: every key."""


def stack_distances(trace: AccessTrace, sample_rate: float = 1.0, seed: int = 0) -> StackResult:
    """Runs the stack algorithm over ``trace`` (exact at ``sample_rate=1``)."""
    if not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
    if _njit is None:
        warnings.warn(
            "numba is not installed: the what-if kernel runs as plain Python (about 100x "
            "slower); install the lab extra (pip install 'kvtestbed[lab]')",
            RuntimeWarning,
            stacklevel=2,
        )
    sampled = sampled_keys(trace.num_keys, sample_rate, seed)
    num_queries = len(trace.query_keys)
    distances = np.empty(num_queries, dtype=np.int64)
    prefix_distances = np.empty(num_queries, dtype=np.int64)
    intervals_s = np.empty(num_queries, dtype=np.float64)
    window = 0 if sample_rate >= 1.0 else math.ceil(EXACT_WINDOW_SAMPLES / sample_rate)
    distinct = _kernel(
        trace.query_offsets,
        trace.ref_offsets,
        trace.query_keys,
        trace.ref_keys,
        trace.step_time_s,
        sampled.astype(np.int64),
        int(np.count_nonzero(sampled[trace.ref_keys])) if len(trace.ref_keys) else 0,
        window,
        distances,
        prefix_distances,
        intervals_s,
    )
    num_refs = max(len(trace.ref_keys), 1)
    window_keys = (
        int(distinct) if window == 0 else min(int(distinct), window * distinct // num_refs)
    )
    return StackResult(
        distances, prefix_distances, intervals_s, sample_rate, int(distinct), int(window_keys)
    )


def sampled_keys(num_keys: int, sample_rate: float, seed: int = 0) -> np.ndarray:
    """bool per key: whether spatial sampling at ``sample_rate`` keeps it (all at 1.0).

    A key is kept when a 64-bit mix of its id and ``seed`` (splitmix64) falls below
    ``sample_rate * 2**64``: a fixed, pattern-independent share of the keys.
    """
    if sample_rate >= 1.0:
        return np.ones(num_keys, dtype=np.bool_)
    with np.errstate(over="ignore"):
        z = np.arange(num_keys, dtype=np.uint64) + np.uint64(
            (0x9E3779B97F4A7C15 * (seed + 1)) % 2**64
        )
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    threshold = np.uint64(min(2**64 - 1, math.floor(sample_rate * 2**64)))
    return z < threshold


def _stack_kernel(
    query_offsets: np.ndarray,
    ref_offsets: np.ndarray,
    query_keys: np.ndarray,
    ref_keys: np.ndarray,
    step_time_s: np.ndarray,
    sampled: np.ndarray,
    num_sampled_refs: int,
    window: int,
    distances: np.ndarray,
    prefix_distances: np.ndarray,
    intervals_s: np.ndarray,
) -> int:
    """Fills the three output arrays; returns the number of distinct keys referenced.

    Per key: ``last_ref`` (index of its last reference, -1: never), ``last_ord`` (sampled
    references made up to and including it). ``tree`` marks each sampled key at its
    ``last_ord``; ``window_tree`` marks, by ring slot, the keys whose last reference is among
    the latest ``window`` references (0: no window, exact mode).
    """
    num_keys = sampled.shape[0]
    tree = np.zeros(num_sampled_refs + 1, dtype=np.int32)
    window_tree = np.zeros(window + 1, dtype=np.int32)
    ring = np.full(max(window, 1), -1, dtype=np.int64)
    last_ref = np.full(num_keys, -1, dtype=np.int64)
    last_ord = np.zeros(num_keys, dtype=np.int64)
    last_time_s = np.zeros(num_keys, dtype=np.float64)
    # counts: [references, sampled references, distinct, sampled distinct, keys in the
    # window, sampled keys in the window]
    n = np.zeros(6, dtype=np.int64)
    for step in range(step_time_s.shape[0]):
        now_s = step_time_s[step]
        oldest_ref = np.int64(2**62)
        oldest_ord = np.int64(0)
        cold = False
        for q in range(query_offsets[step], query_offsets[step + 1]):
            key = query_keys[q]
            if last_ref[key] < 0:
                distances[q] = COLD
                intervals_s[q] = np.nan
                cold = True
            else:
                distances[q] = _distance(tree, window_tree, window, last_ref[key], last_ord[key], n)
                intervals_s[q] = now_s - last_time_s[key]
                if last_ref[key] < oldest_ref:
                    oldest_ref = last_ref[key]
                    oldest_ord = last_ord[key]
            if cold:
                prefix_distances[q] = COLD
            else:
                prefix_distances[q] = _distance(
                    tree, window_tree, window, oldest_ref, oldest_ord, n
                )
        for r in range(ref_offsets[step], ref_offsets[step + 1]):
            _reference(
                ref_keys[r], now_s, window, sampled, tree, window_tree, ring, last_ref, last_ord,
                last_time_s, n,
            )  # fmt: skip
    return int(n[2])


def _reference_impl(
    key: int,
    now_s: float,
    window: int,
    sampled: np.ndarray,
    tree: np.ndarray,
    window_tree: np.ndarray,
    ring: np.ndarray,
    last_ref: np.ndarray,
    last_ord: np.ndarray,
    last_time_s: np.ndarray,
    n: np.ndarray,
) -> None:
    """One reference to ``key`` at ``now_s``: it becomes the key's last reference, in the
    trees (the sampled one if the key is sampled, the window's ring) and the counts ``n``
    (:func:`_stack_kernel`)."""
    refs = n[0]
    if last_ref[key] < 0:
        n[2] += 1
    if window > 0:
        slot = refs % window
        if refs >= window:  # reference refs - window leaves the window
            leaving = ring[slot]
            if last_ref[leaving] == refs - window:
                _add(window_tree, slot + 1, -1)
                n[4] -= 1
                n[5] -= sampled[leaving]
        previous = last_ref[key]
        if previous >= 0 and previous > refs - window:
            _add(window_tree, previous % window + 1, -1)
            n[4] -= 1
            n[5] -= sampled[key]
        ring[slot] = key
        _add(window_tree, slot + 1, 1)
        n[4] += 1
        n[5] += sampled[key]
    if sampled[key]:
        n[1] += 1
        if last_ref[key] >= 0:
            _add(tree, last_ord[key], -1)
        else:
            n[3] += 1
        _add(tree, n[1], 1)
    last_ref[key] = refs
    last_ord[key] = n[1]
    last_time_s[key] = now_s
    n[0] += 1


def _distance_impl(
    tree: np.ndarray,
    window_tree: np.ndarray,
    window: int,
    position_ref: int,
    position_ord: int,
    n: np.ndarray,
) -> int:
    """1 + (estimated) distinct keys referenced after reference ``position_ref``.

    Inside the window the count is exact; beyond it, the keys in the window are exact and the
    older ones are the sampled count scaled by distinct / sampled-distinct keys.
    """
    refs = n[0]
    if window > 0 and position_ref >= refs - window:
        low = position_ref + 1
        high = refs - 1
        if low > high:
            return 1
        a = low % window
        b = high % window
        if a <= b:
            return 1 + _prefix(window_tree, b + 1) - _prefix(window_tree, a)
        return (
            1 + _prefix(window_tree, window) - _prefix(window_tree, a) + _prefix(window_tree, b + 1)
        )
    after = n[3] - _prefix(tree, position_ord)
    if n[3] == n[2]:
        return 1 + after
    older = after - n[5]
    if n[3] == 0 or older <= 0:
        return 1 + n[4]
    return 1 + n[4] + int(round(older * n[2] / n[3]))


def _prefix_impl(tree: np.ndarray, i: int) -> int:
    """Sum of the first ``i`` entries of a Fenwick tree."""
    total = 0
    while i > 0:
        total += tree[i]
        i -= i & -i
    return total


def _add_impl(tree: np.ndarray, i: int, delta: int) -> None:
    size = tree.shape[0] - 1
    while i <= size:
        tree[i] += delta
        i += i & -i


_prefix = _compiled(_prefix_impl)
_add = _compiled(_add_impl)
_distance = _compiled(_distance_impl)
_reference = _compiled(_reference_impl)
_kernel = _compiled(_stack_kernel)
