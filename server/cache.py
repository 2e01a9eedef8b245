"""The cache index: objects, capacity, eviction, read locks and pins. Pure Python.

Invariants (checked by :meth:`KVCache.check_invariants`, which the tests call):

- ``used_bytes`` is the sum of all objects' footprints (size rounded up to the pool's 64-byte
  alignment, in metadata-only mode too, so both modes evict alike), reserved or committed,
  and never exceeds ``capacity_bytes``;
- only committed objects with no read lock and no pin are ever evicted;
- an object's ``locks`` equals the sum of its lock entries' counts.

A *read lock* is taken by a lookup on behalf of a session (one unit per expected reader) and
released by a retrieve, an explicit free, the lock TTL, or the death of the client that took
it. A *pin* protects an object while a worker copies out of it (retrieve begin → end).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from server.policies import EvictionPolicy
from server.pool import ExtentAllocator, align


class ObjectKey(NamedTuple):
    model: str
    world_size: int
    kv_rank: int
    chunk_hash: bytes
    cache_salt: str


@dataclass(slots=True)
class CacheObject:
    key: ObjectKey
    nbytes: int
    offset: int | None
    """Pool offset; ``None`` in metadata-only mode."""
    origin: str = ""
    """``traceparent`` of the store that wrote the object (eviction spans link to it)."""
    committed: bool = False
    locks: int = 0
    pins: int = 0

    @property
    def footprint(self) -> int:
        return align(self.nbytes)

    @property
    def evictable(self) -> bool:
        return self.committed and self.locks == 0 and self.pins == 0


@dataclass(slots=True)
class _LockEntry:
    count: int
    client: bytes
    taken_at: float
    expires_at: float
    generation: int


@dataclass(frozen=True)
class Released:
    """Locks that went away together (an expiry sweep or a client's death)."""

    session_id: str
    keys: list[ObjectKey]
    num_locks: int
    held_s: float


@dataclass
class Eviction:
    """Objects evicted together to make room (or dropped for another reason)."""

    reason: str
    keys: list[ObjectKey] = field(default_factory=list)
    nbytes: int = 0
    origins: list[str] = field(default_factory=list)


class KVCache:
    def __init__(
        self,
        capacity_bytes: int,
        policy: EvictionPolicy,
        allocator: ExtentAllocator | None,
        clock: Callable[[], float],
        read_lock_ttl_s: float,
    ) -> None:
        self.capacity_bytes = capacity_bytes
        self.policy = policy
        self.allocator = allocator
        self.clock = clock
        self.read_lock_ttl_s = read_lock_ttl_s
        self.used_bytes = 0
        self._objects: dict[ObjectKey, CacheObject] = {}
        self._by_hash: dict[bytes, set[ObjectKey]] = {}
        self._locks: dict[tuple[str, ObjectKey], _LockEntry] = {}
        self._locks_by_session: dict[str, set[ObjectKey]] = {}
        self._sessions_by_client: dict[bytes, set[str]] = {}
        self._expiry: list[tuple[float, int, str, ObjectKey]] = []
        self._generation = itertools.count()

    # -----------------------------------------------------------------------------------------
    # Objects
    # -----------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._objects)

    def get(self, key: ObjectKey) -> CacheObject | None:
        return self._objects.get(key)

    def committed(self, key: ObjectKey) -> CacheObject | None:
        obj = self._objects.get(key)
        return obj if obj is not None and obj.committed else None

    def reserve(
        self, key: ObjectKey, nbytes: int, origin: str, eviction: Eviction
    ) -> CacheObject | None:
        """A new uncommitted object of ``nbytes``, evicting into ``eviction`` to make room.

        ``None`` if the bytes cannot be found without touching locked, pinned or uncommitted
        objects. The key must not exist.
        """
        assert key not in self._objects, key
        placed, offset = self._make_room(nbytes, eviction)
        if not placed:
            return None
        obj = CacheObject(key=key, nbytes=nbytes, offset=offset, origin=origin)
        self._objects[key] = obj
        self._by_hash.setdefault(key.chunk_hash, set()).add(key)
        self.used_bytes += obj.footprint
        return obj

    def commit(self, obj: CacheObject) -> None:
        obj.committed = True
        self.policy.inserted(obj.key)

    def remove(self, obj: CacheObject) -> None:
        """Drops an object (an aborted reservation or an eviction victim)."""
        del self._objects[obj.key]
        same_hash = self._by_hash[obj.key.chunk_hash]
        same_hash.discard(obj.key)
        if not same_hash:
            del self._by_hash[obj.key.chunk_hash]
        self.used_bytes -= obj.footprint
        if obj.offset is not None and self.allocator is not None:
            self.allocator.free(obj.offset)
        if obj.committed:
            self.policy.removed(obj.key)

    def keys_with_hash(self, chunk_hash: bytes) -> list[ObjectKey]:
        return sorted(self._by_hash.get(chunk_hash, ()))

    def drop(self, obj: CacheObject, eviction: Eviction) -> int:
        """Removes a committed, unpinned object even if locked; returns the locks released."""
        assert obj.committed and obj.pins == 0
        released = 0
        for session_id, key in [k for k in self._locks if k[1] == obj.key]:
            released += self.unlock(session_id, key)
        eviction.keys.append(obj.key)
        eviction.nbytes += obj.footprint
        if obj.origin:
            eviction.origins.append(obj.origin)
        self.remove(obj)
        return released

    def touch(self, key: ObjectKey) -> None:
        if key in self._objects:
            self.policy.accessed(key)

    def _make_room(self, nbytes: int, eviction: Eviction) -> tuple[bool, int | None]:
        """``(True, pool offset)`` for ``nbytes`` (offset ``None`` in metadata-only mode), or
        ``(False, None)`` when evicting every evictable object would not make room."""
        footprint = align(nbytes)
        if footprint > self.capacity_bytes:
            return False, None
        while True:
            if self.used_bytes + footprint <= self.capacity_bytes:
                if self.allocator is None:
                    return True, None
                offset = self.allocator.allocate(nbytes)
                if offset is not None:
                    return True, offset
            victim = self._next_victim()
            if victim is None:
                return False, None
            eviction.keys.append(victim.key)
            eviction.nbytes += victim.footprint
            if victim.origin:
                eviction.origins.append(victim.origin)
            self.remove(victim)

    def _next_victim(self) -> CacheObject | None:
        for key in self.policy.candidates():
            obj = self._objects[key]  # type: ignore[index]
            if obj.evictable:
                return obj
        return None

    # -----------------------------------------------------------------------------------------
    # Read locks
    # -----------------------------------------------------------------------------------------

    @property
    def num_locks(self) -> int:
        return sum(entry.count for entry in self._locks.values())

    def lock(self, session_id: str, client: bytes, key: ObjectKey, count: int) -> None:
        obj = self._objects[key]
        now = self.clock()
        generation = next(self._generation)
        expires_at = now + self.read_lock_ttl_s
        entry = self._locks.get((session_id, key))
        if entry is None:
            self._locks[(session_id, key)] = _LockEntry(count, client, now, expires_at, generation)
            self._locks_by_session.setdefault(session_id, set()).add(key)
            self._sessions_by_client.setdefault(client, set()).add(session_id)
        else:
            entry.count += count
            entry.expires_at = expires_at
            entry.generation = generation
        obj.locks += count
        heapq.heappush(self._expiry, (expires_at, generation, session_id, key))

    def unlock(self, session_id: str, key: ObjectKey, count: int | None = None) -> int:
        """Releases ``count`` of the session's lock units on ``key`` (all if ``None``)."""
        entry = self._locks.get((session_id, key))
        if entry is None:
            return 0
        released = entry.count if count is None else min(count, entry.count)
        entry.count -= released
        self._objects[key].locks -= released
        if entry.count == 0:
            self._drop_entry(session_id, key)
        return released

    def locked_keys(self, session_id: str) -> set[ObjectKey]:
        return set(self._locks_by_session.get(session_id, ()))

    def unlock_session(self, session_id: str) -> int:
        return sum(self.unlock(session_id, key) for key in self.locked_keys(session_id))

    def unlock_client(self, client: bytes) -> list[Released]:
        """Releases every lock a (dead) client took."""
        released = []
        now = self.clock()
        for session_id in sorted(self._sessions_by_client.get(client, ())):
            keys = sorted(self.locked_keys(session_id))
            held = [now - self._locks[(session_id, key)].taken_at for key in keys]
            num = self.unlock_session(session_id)
            if num:
                released.append(Released(session_id, keys, num, max(held)))
        self._sessions_by_client.pop(client, None)
        return released

    def expire_locks(self) -> list[Released]:
        """Releases lock entries whose TTL passed; one :class:`Released` per session."""
        now = self.clock()
        by_session: dict[str, tuple[list[ObjectKey], int, float]] = {}
        while self._expiry and self._expiry[0][0] <= now:
            _, generation, session_id, key = heapq.heappop(self._expiry)
            entry = self._locks.get((session_id, key))
            if entry is None or entry.generation != generation:
                continue  # already released, or re-locked with a later expiry
            keys, num, held = by_session.get(session_id, ([], 0, 0.0))
            keys.append(key)
            by_session[session_id] = (keys, num + entry.count, max(held, now - entry.taken_at))
            self.unlock(session_id, key)
        return [Released(s, keys, num, held) for s, (keys, num, held) in by_session.items()]

    def _drop_entry(self, session_id: str, key: ObjectKey) -> None:
        entry = self._locks.pop((session_id, key))
        keys = self._locks_by_session[session_id]
        keys.discard(key)
        if not keys:
            del self._locks_by_session[session_id]
            sessions = self._sessions_by_client.get(entry.client)
            if sessions is not None:
                sessions.discard(session_id)
                if not sessions:
                    del self._sessions_by_client[entry.client]

    # -----------------------------------------------------------------------------------------
    # Pins
    # -----------------------------------------------------------------------------------------

    @property
    def num_pins(self) -> int:
        return sum(obj.pins for obj in self._objects.values())

    def pin(self, obj: CacheObject) -> None:
        obj.pins += 1

    def unpin(self, key: ObjectKey) -> None:
        obj = self._objects.get(key)
        if obj is not None and obj.pins > 0:
            obj.pins -= 1

    # -----------------------------------------------------------------------------------------
    # Checks
    # -----------------------------------------------------------------------------------------

    def objects(self) -> Iterable[CacheObject]:
        return self._objects.values()

    def check_invariants(self) -> None:
        used = sum(obj.footprint for obj in self._objects.values())
        assert used == self.used_bytes, (used, self.used_bytes)
        assert self.used_bytes <= self.capacity_bytes, (self.used_bytes, self.capacity_bytes)
        per_object: dict[ObjectKey, int] = {}
        for (_, key), entry in self._locks.items():
            assert entry.count > 0
            per_object[key] = per_object.get(key, 0) + entry.count
        for obj in self._objects.values():
            assert obj.locks == per_object.get(obj.key, 0), (obj.key, obj.locks)
            assert obj.pins >= 0
