"""How a chunk object is one Redis value, and the key it is stored under. Pure.

Value layout (all integers little-endian)::

    b"KVTB" | version u8 (1) | key length u16 | key | blake3(key || data) 32 bytes | data

The key is the hierarchy's key of the object (a :data:`~testbed.core.keys.ChunkHash`, as
``server.tiers.base`` names it), so a value read back names exactly what it holds.
:func:`decode_object` returns the bytes only if the value is well formed, names the key it was
read for, and its digest matches: a truncated, overwritten or foreign value is ``None``, never
bytes.

The Redis key is ``NAMESPACE:`` followed by the key's hex: the same on every server that shares
the store, which is what lets one server hit what another wrote.
"""

from __future__ import annotations

import struct

import blake3

from testbed.core.keys import ChunkHash

MAGIC = b"KVTB"
VERSION = 1
DIGEST_BYTES = 32
_HEADER = struct.Struct("<4sBH")


def redis_key(namespace: str, key: ChunkHash) -> bytes:
    return namespace.encode() + b":" + key.hex().encode()


def encode_object(key: ChunkHash, data: bytes) -> bytes:
    name = bytes(key)
    digest = _digest(name, data)
    return b"".join((_HEADER.pack(MAGIC, VERSION, len(name)), name, digest, data))


def data_size(key: ChunkHash, value_nbytes: int) -> int | None:
    """The data's size in a value of ``value_nbytes`` for ``key`` (``None``: no such value)."""
    size = value_nbytes - _HEADER.size - len(key) - DIGEST_BYTES
    return size if value_nbytes > 0 and size >= 0 else None


def decode_object(key: ChunkHash, value: bytes) -> bytes | None:
    """The data of ``value`` if it is a sound object for ``key`` (module docstring)."""
    if len(value) < _HEADER.size:
        return None
    magic, version, name_bytes = _HEADER.unpack_from(value)
    start = _HEADER.size
    if magic != MAGIC or version != VERSION or len(value) < start + name_bytes + DIGEST_BYTES:
        return None
    name = value[start : start + name_bytes]
    if name != key:
        return None
    digest = value[start + name_bytes : start + name_bytes + DIGEST_BYTES]
    data = bytes(memoryview(value)[start + name_bytes + DIGEST_BYTES :])
    if _digest(name, data) != digest:
        return None
    return data


def _digest(name: bytes, data: bytes) -> bytes:
    hasher = blake3.blake3(name)
    hasher.update(data)
    return hasher.digest()
