"""Chunk keys: a rolling prefix hash over complete chunks of token ids.

``h_i = blake3(h_{i-1} || tokens[i*C:(i+1)*C] as little-endian uint32)``, truncated to 16 bytes,
with ``h_{-1}`` a fixed seed. A chunk's hash therefore names the chunk *together with
everything before it*: two prompts share chunk ``i``'s key exactly when their first
``(i+1)*C`` tokens are equal. A trailing partial chunk has no hash and is never stored.

The cache salt, model, world size and KV rank are not hashed in; they are separate fields of
the server's object key, so a salt or model change can never alias another's objects.
"""

from __future__ import annotations

from collections.abc import Sequence

import blake3
import numpy as np

# A 16-byte rolling prefix hash (the wire protocol checks the length).
ChunkHash = bytes

HASH_BYTES = 16
_SEED = blake3.blake3(b"kvtestbed.keys.v1").digest(HASH_BYTES)


def chunk_hashes(
    token_ids: Sequence[int] | np.ndarray,
    chunk_size: int,
    *,
    num_chunks: int | None = None,
) -> list[ChunkHash]:
    """Hashes of the complete chunks of ``token_ids`` (at most ``num_chunks`` of them)."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    limit = len(token_ids) // chunk_size
    if num_chunks is not None:
        limit = min(limit, num_chunks)
    return extend_chunk_hashes([], token_ids, chunk_size, limit)


def extend_chunk_hashes(
    hashes: list[ChunkHash],
    token_ids: Sequence[int] | np.ndarray,
    chunk_size: int,
    num_chunks: int,
) -> list[ChunkHash]:
    """Extends ``hashes`` in place to cover ``num_chunks`` chunks of ``token_ids``; returns it.

    Lets a tracker hash a growing sequence incrementally (each chunk is hashed once).
    """
    if num_chunks * chunk_size > len(token_ids):
        raise ValueError(
            f"{num_chunks} chunks of {chunk_size} tokens need {num_chunks * chunk_size} tokens, "
            f"have {len(token_ids)}"
        )
    start = len(hashes)
    if num_chunks <= start:
        return hashes
    tokens = _as_uint32(token_ids[start * chunk_size : num_chunks * chunk_size])
    data = tokens.tobytes()
    step = chunk_size * 4
    prev = hashes[-1] if hashes else _SEED
    for i in range(num_chunks - start):
        prev = blake3.blake3(prev + data[i * step : (i + 1) * step]).digest(HASH_BYTES)
        hashes.append(prev)
    return hashes


def _as_uint32(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    array = np.asarray(token_ids)
    if array.size and (array.min() < 0 or array.max() > 0xFFFFFFFF):
        raise ValueError("token ids must fit in uint32")
    return array.astype("<u4", copy=False)
