"""The cache index's records: object keys and objects, namespaces, lock groups, evictions.

Plain data, shared by the index (``server.cache``), the server's state (``server.state``) and
the handlers; no behaviour beyond what each record computes of itself.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import NamedTuple

from server.pool import align
from testbed.core.keys import ChunkHash


class ObjectKey(NamedTuple):
    model: str
    world_size: int
    kv_rank: int
    chunk_hash: ChunkHash
    cache_salt: str


@dataclass(slots=True, eq=False)
class CacheObject:
    key: ObjectKey
    nbytes: int
    offset: int | None
    """Pool offset; ``None`` in metadata-only mode."""
    origin: str = ""
    """``traceparent`` of the store that wrote the object (eviction spans link to it)."""
    storer: str = ""
    """Session id of the request whose store wrote the object."""
    committed: bool = False
    locks: int = 0
    pins: int = 0
    inserted: int = 0
    last_access: int = 0
    hits: int = 0
    version: int = 0
    """Renewed whenever the object's heap entry goes stale (priority or evictability), from
    the cache's counter, so no other object's old entry under the same key can match it."""

    @property
    def footprint(self) -> int:
        return align(self.nbytes)

    @property
    def evictable(self) -> bool:
        return self.committed and self.locks == 0 and self.pins == 0


class Space(NamedTuple):
    """What names a chunk's objects besides its hash: one per KV rank of ``world_size``."""

    model: str
    world_size: int
    cache_salt: str

    def key(self, chunk_hash: ChunkHash, kv_rank: int) -> ObjectKey:
        return _new_key(ObjectKey, (self[0], self[1], kv_rank, chunk_hash, self[2]))

    def keys(self, chunk_hash: ChunkHash) -> list[ObjectKey]:
        model, world_size, salt = self
        return [
            _new_key(ObjectKey, (model, world_size, rank, chunk_hash, salt))
            for rank in range(world_size)
        ]


_new_key = tuple.__new__  # builds an ObjectKey without NamedTuple's Python-level __new__


@dataclass(slots=True, eq=False)
class LockGroup:
    """The read locks of one lookup: for chunk ``i`` and KV rank ``r``, ``units[i * W + r]``
    lock units are left on ``space.key(hashes[i], r)`` (``W`` the world size). Compact: about
    60 bytes per chunk, the keys are rebuilt when needed."""

    handle: bytes
    session_id: str
    owner: bytes
    space: Space
    hashes: list[ChunkHash]
    units: array
    taken_at: float
    expires_at: float
    num_units: int = 0

    @property
    def keys(self) -> list[ObjectKey]:
        return [key for h in self.hashes for key in self.space.keys(h)]


@dataclass(frozen=True)
class Released:
    """Locks that went away together (an expiry or a client's death)."""

    session_id: str
    keys: list[ObjectKey]
    num_locks: int
    held_s: float


@dataclass
class Eviction:
    """Objects evicted together to make room (or dropped for another reason)."""

    reason: str
    objects: list[CacheObject] = field(default_factory=list)
    nbytes: int = 0

    @property
    def keys(self) -> list[ObjectKey]:
        return [obj.key for obj in self.objects]

    @property
    def origins(self) -> list[str]:
        return [obj.origin for obj in self.objects if obj.origin]

    def add(self, obj: CacheObject) -> None:
        self.objects.append(obj)
        self.nbytes += obj.footprint
