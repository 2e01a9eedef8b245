"""How an object's bytes travel below L1: framed with its key and a checksum, verified on read.

A lower tier holds ``MAGIC | length | blake3(key, payload) | payload``. :func:`unframe` gives the
payload back only if the magic, the length and the digest all match the key asked for, so a
store that returns another object's bytes, a truncated file or a flipped bit is a read
failure (cause ``corrupt``), never bytes served to a worker. Pure functions.
"""

from __future__ import annotations

import struct

import blake3

from server.objects import ObjectKey
from testbed.core.keys import ChunkHash

MAGIC = b"KVT1"
_DIGEST_BYTES = 16
_HEADER = struct.Struct("<4sQ16s")
HEADER_BYTES = _HEADER.size


def store_key(key: ObjectKey) -> ChunkHash:
    """The key of an L1 object in a lower tier: a digest of all that names the object (model,
    world size, KV rank, chunk hash, salt), so one store can hold every namespace."""
    digest = blake3.blake3()
    for part in (key.model, str(key.world_size), str(key.kv_rank), key.cache_salt):
        encoded = part.encode()
        digest.update(struct.pack("<I", len(encoded)) + encoded)
    digest.update(key.chunk_hash)
    return ChunkHash(digest.digest(_DIGEST_BYTES))


def frame(key: ChunkHash, payload: bytes | memoryview) -> bytes:
    return _HEADER.pack(MAGIC, len(payload), _digest(key, payload)) + bytes(payload)


def unframe(key: ChunkHash, data: bytes) -> memoryview | None:
    """The payload of ``data`` if it is ``key``'s object intact; ``None`` otherwise."""
    if len(data) < HEADER_BYTES:
        return None
    magic, length, digest = _HEADER.unpack_from(data)
    payload = memoryview(data)[HEADER_BYTES:]
    if magic != MAGIC or length != len(payload) or digest != _digest(key, payload):
        return None
    return payload


def _digest(key: ChunkHash, payload: bytes | memoryview) -> bytes:
    hasher = blake3.blake3(key)
    hasher.update(payload)
    return hasher.digest(_DIGEST_BYTES)
