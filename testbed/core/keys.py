"""Chunk keys: a rolling prefix hash over complete chunks of token ids and what else decides
their KV.

``h_i = blake3(h_{i-1} || tokens[i*C:(i+1)*C] as little-endian uint32 [|| 0xff || extras_i])``,
truncated to 16 bytes, with ``h_{-1}`` a fixed seed. A chunk's hash therefore names the chunk
*together with everything before it*: two prompts share chunk ``i``'s key exactly when their
first ``(i+1)*C`` tokens are equal and so are the extras of every chunk up to ``i``.

The extras are what vLLM's own block hashes add to the tokens (its ``extra_keys`` per block),
so that a key means what vLLM's mean: two requests with the same tokens under different LoRA
adapters, or with different images behind the same placeholder tokens, never share a key.
``extras_i`` is the canonical MessagePack encoding of the chunk's extra keys, in vLLM's
order: ``("lora", name, path)`` for a request with a LoRA adapter (every chunk), then
``("mm", identifier, offset - chunk start)`` for every multimodal input whose placeholder
tokens overlap the chunk. A chunk without extras hashes exactly as a plain token chunk.

The cache salt, model, world size and KV rank are not hashed in; they are separate fields of
the server's object key, so a salt or model change can never alias another's objects. A
trailing partial chunk has no hash and is never stored.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType

import blake3
import msgspec
import numpy as np

HASH_BYTES = 16
ChunkHash = NewType("ChunkHash", bytes)
"""A chunk's key: the rolling prefix hash of its tokens and everything before them,
:data:`HASH_BYTES` long, as :func:`chunk_hashes` makes it (benchmarks and probes wrap
synthetic ones of the same length); the wire protocol's ``WireChunkHash`` is this type with
its length checked. A distinct type, so that a signature says where a chunk key passes."""
_SEED = blake3.blake3(b"kvtestbed.keys.v1").digest(HASH_BYTES)
_EXTRAS_MARK = b"\xff"
_encode = msgspec.msgpack.Encoder().encode


@dataclass(frozen=True)
class MultiModalInput:
    """One multimodal item of a prompt (vLLM's ``MultiModalFeatureSpec``): the hash of its
    content and the placeholder tokens ``[offset, offset + length)`` it fills."""

    identifier: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if not self.identifier or self.offset < 0 or self.length <= 0:
            raise ValueError(
                f"a multimodal input needs an identifier, an offset >= 0 and a length > 0, "
                f"got {self}"
            )


@dataclass(frozen=True)
class KeyExtras:
    """What besides its tokens decides a request's KV (vLLM's block-hash extra keys)."""

    lora: tuple[str, str] | None = None
    """The LoRA adapter's ``(name, path)``; vLLM keys both, so that re-pointing a name at
    another adapter does not reuse KV computed with the previous one."""
    mm_inputs: tuple[MultiModalInput, ...] = ()
    """The prompt's multimodal inputs, in placeholder order."""

    def __post_init__(self) -> None:
        offsets = [item.offset for item in self.mm_inputs]
        if offsets != sorted(offsets):
            raise ValueError("multimodal inputs must be given in placeholder order")

    def __bool__(self) -> bool:
        return self.lora is not None or bool(self.mm_inputs)

    def chunk_keys(self, start: int, end: int) -> list[tuple[str | int, ...]]:
        """The extra keys of the tokens ``[start, end)`` (empty when none apply)."""
        keys: list[tuple[str | int, ...]] = []
        if self.lora is not None:
            keys.append(("lora", *self.lora))
        for item in self.mm_inputs:
            if item.offset < end and start < item.offset + item.length:
                keys.append(("mm", item.identifier, item.offset - start))
        return keys


def chunk_hashes(
    token_ids: Sequence[int] | np.ndarray,
    chunk_size: int,
    *,
    num_chunks: int | None = None,
    extras: KeyExtras | None = None,
) -> list[ChunkHash]:
    """Hashes of the complete chunks of ``token_ids`` (at most ``num_chunks`` of them)."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    limit = len(token_ids) // chunk_size
    if num_chunks is not None:
        limit = min(limit, num_chunks)
    return extend_chunk_hashes([], token_ids, chunk_size, limit, extras)


def extend_chunk_hashes(
    hashes: list[ChunkHash],
    token_ids: Sequence[int] | np.ndarray,
    chunk_size: int,
    num_chunks: int,
    extras: KeyExtras | None = None,
) -> list[ChunkHash]:
    """Extends ``hashes`` in place to cover ``num_chunks`` chunks of ``token_ids``; returns it.

    Lets a tracker hash a growing sequence incrementally (each chunk is hashed once); the
    ``extras`` must be the same on every call for one sequence.
    """
    if num_chunks * chunk_size > len(token_ids):
        raise ValueError(
            f"{num_chunks} chunks of {chunk_size} tokens need {num_chunks * chunk_size} tokens, "
            f"have {len(token_ids)}"
        )
    start = len(hashes)
    if num_chunks <= start:
        return hashes
    data = _uint32_bytes(token_ids[start * chunk_size : num_chunks * chunk_size])
    step = chunk_size * 4
    prev: bytes = hashes[-1] if hashes else _SEED
    for i in range(num_chunks - start):
        block = prev + data[i * step : (i + 1) * step]
        if extras:
            first = (start + i) * chunk_size
            keys = extras.chunk_keys(first, first + chunk_size)
            if keys:
                block += _EXTRAS_MARK + _encode(keys)
        digest = ChunkHash(blake3.blake3(block).digest(HASH_BYTES))
        hashes.append(digest)
        prev = digest
    return hashes


def _uint32_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """The ids as little-endian uint32, the bytes a chunk's hash covers. A list of ints (what
    vLLM's requests hold) is packed by ``array`` (about 4× numpy's conversion of a list);
    anything it refuses takes numpy's route, which checks the range."""
    if not isinstance(token_ids, np.ndarray):
        try:
            packed = array.array("I", token_ids)
        except (OverflowError, TypeError):
            pass  # out of range or not ints: numpy's route says which
        else:
            if packed.itemsize == 4:
                if sys.byteorder != "little":
                    packed.byteswap()
                return packed.tobytes()
    return _as_uint32(token_ids).tobytes()


def _as_uint32(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    array = np.asarray(token_ids)
    if array.size and (array.min() < 0 or array.max() > 0xFFFFFFFF):
        raise ValueError("token ids must fit in uint32")
    return array.astype("<u4", copy=False)
