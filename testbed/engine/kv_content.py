"""Deterministic KV content: what a computed token's KV holds in the replay engine.

The value of element ``j`` of layer ``l`` at position ``p`` is a function of the whole prefix
``tokens[0..p]`` (like real KV), computed vectorised: ``H_p = Σ_{i≤p} t_i r^(p-i) mod 2^64``
(a polynomial rolling hash, ``H_p = r^p · cumsum(t_i r^-i)``, with ``r`` odd hence invertible
mod 2^64), mixed with per-layer and per-element constants into 16-bit patterns. Any block
that arrives from the cache can therefore be checked bit for bit against what the engine
would have computed; a wrong chunk, a wrong offset or a wrong rank all show up.
"""

from __future__ import annotations

import numpy as np

_R = np.uint64(0x9E3779B97F4A7C15)
_R_INV = np.uint64(pow(int(_R), -1, 1 << 64))
_MIX = np.uint64(0xBF58476D1CE4E5B9)


def prefix_hashes(token_ids: np.ndarray) -> np.ndarray:
    """``H_p`` for every position (uint64), each a function of ``tokens[0..p]``."""
    n = len(token_ids)
    if n == 0:
        return np.zeros(0, dtype=np.uint64)
    with np.errstate(over="ignore"):
        powers = np.cumprod(np.full(n, _R, dtype=np.uint64))  # r^1 .. r^n
        inverse_powers = np.cumprod(np.full(n, _R_INV, dtype=np.uint64))  # r^-1 .. r^-n
        tokens = token_ids.astype(np.uint64) + np.uint64(1)
        return powers * np.cumsum(tokens * inverse_powers)


def element_constants(num_layers: int, num_elements: int) -> np.ndarray:
    """Odd 64-bit multipliers, one per (layer, element): shape ``(num_layers, num_elements)``."""
    index = np.arange(num_layers * num_elements, dtype=np.uint64).reshape(num_layers, num_elements)
    with np.errstate(over="ignore"):
        return (index * np.uint64(0xD1342543DE82EF95) + np.uint64(0x2545F4914F6CDD1D)) | np.uint64(
            1
        )


def kv_values(hashes: np.ndarray, constants: np.ndarray) -> np.ndarray:
    """int16 KV of shape ``(len(hashes), elements)`` for one layer's ``constants`` row."""
    with np.errstate(over="ignore"):
        mixed = (hashes * _MIX)[:, None] * constants[None, :]
    return (mixed >> np.uint64(48)).astype(np.uint16).view(np.int16)
