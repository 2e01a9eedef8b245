"""Deterministic KV content: what a computed token's KV holds in the replay engine.

Every position ``p`` of a request has a prefix hash ``H_p = Σ_{i≤p} t_i r^(p-i) mod 2^64``, a
function of the whole prefix ``tokens[0..p]`` (like real KV), computed vectorised (a polynomial
rolling hash, ``H_p = r^p · cumsum(t_i r^-i)``, with ``r`` odd hence invertible mod 2^64).
From it each layer gets a 16-bit code per position (:func:`layer_codes`), and element ``j`` of
layer ``l`` at position ``p`` holds ``code[p, l] XOR c[l, j]``, with ``c`` a fixed 16-bit
constant per (layer, element) of the full model (:func:`element_constants`; a TP rank holds
its heads' slice of them). Writing a step's KV is then one broadcast XOR per layer, and any
block that arrives from the cache can be checked bit for bit against what the engine would
have computed: a wrong chunk or a wrong offset changes the codes, a wrong rank or layer the
constants, and a corrupted element its own value.
"""

from __future__ import annotations

import numpy as np

_R = np.uint64(0x9E3779B97F4A7C15)
_R_INV = np.uint64(pow(int(_R), -1, 1 << 64))
_MIX = np.uint64(0xBF58476D1CE4E5B9)
_MASK = (1 << 64) - 1


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


def next_hash(previous: int, token: int) -> int:
    """``H_p`` from ``H_{p-1}`` (0 before the first token) and ``t_p``: ``r·H_{p-1} + t_p + 1``,
    continuing :func:`prefix_hashes` by one token (plain ints: one token at a time)."""
    return (previous * int(_R) + token + 1) & _MASK


def _layer_multipliers(num_layers: int) -> np.ndarray:
    return np.arange(num_layers, dtype=np.uint64) * np.uint64(2) + np.uint64(0x9E37)


def layer_codes(hashes: np.ndarray, num_layers: int) -> np.ndarray:
    """uint16 codes of shape ``(len(hashes), num_layers)``: the top 16 bits of ``H_p`` mixed
    with an odd multiplier per layer."""
    with np.errstate(over="ignore"):
        mixed = (hashes * _MIX)[:, None] * _layer_multipliers(num_layers)[None, :]
    return (mixed >> np.uint64(48)).astype(np.uint16)


def layer_codes_of(hash_value: int, num_layers: int) -> list[int]:
    """:func:`layer_codes` of one ``H_p`` (plain ints)."""
    mixed = hash_value * int(_MIX) & _MASK
    return [(mixed * int(m) & _MASK) >> 48 for m in _layer_multipliers(num_layers)]


def element_constants(num_layers: int, num_elements: int) -> np.ndarray:
    """uint16 constants, one per (layer, element): shape ``(num_layers, num_elements)``."""
    index = np.arange(num_layers * num_elements, dtype=np.uint64).reshape(num_layers, num_elements)
    with np.errstate(over="ignore"):
        mixed = index * np.uint64(0xD1342543DE82EF95) + np.uint64(0x2545F4914F6CDD1D)
    return (mixed >> np.uint64(48)).astype(np.uint16)


def kv_values(codes: np.ndarray, constants: np.ndarray) -> np.ndarray:
    """int16 KV of shape ``(len(codes), elements)`` from one layer's codes (uint16, one per
    position) and its ``constants`` row (uint16)."""
    return (codes[:, None] ^ constants[None, :]).view(np.int16)
