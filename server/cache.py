"""The cache index: objects, capacity, eviction, lock groups and pins. Pure Python.

Its records (keys, objects, namespaces, lock groups, evictions) are ``server.objects``.

Invariants (checked by :meth:`KVCache.check_invariants`, which the tests call):

- ``used_bytes`` is the sum of all objects' footprints (size rounded up to the pool's 64-byte
  alignment, in metadata-only mode too, so both modes evict alike), reserved or committed,
  and never exceeds ``capacity_bytes``;
- only committed objects with no read lock and no pin are ever evicted;
- an object's ``locks`` equals the lock units all lock groups hold on it;
- the eviction heap holds a valid entry for every evictable object.

A *lock group* is what one lookup took: for each chunk of its hit, ``num_readers`` lock units
on the object of every KV rank, named by a random handle. Units go back by a retrieve (one
unit per reading rank), an explicit free of a token range, the group's TTL, or the death of
the client that took it. A *pin* protects an object while a worker copies out of it
(retrieve begin → end). Eviction order comes from the policy's priority keys over one lazy
heap (see ``testbed.core.policies``): O(log n) per eviction for every policy.
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from collections.abc import Callable, Iterable

from server.objects import CacheObject, Eviction, LockGroup, ObjectKey, Released, Space
from server.pool import ExtentAllocator, align
from testbed.core.keys import ChunkHash
from testbed.core.policies import EvictionPolicy

# Estimated index memory per object, lock-group chunk and session (CPython objects, dict and
# heap entries); reported in stats so that memory outside the pool is visible.
OBJECT_INDEX_BYTES = 640
LOCKED_CHUNK_INDEX_BYTES = 120


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
        self.num_locks = 0
        self.num_pins = 0
        self.eviction_work = 0
        """Heap entries examined by victim selection (a machine-independent cost measure)."""
        self._objects: dict[ObjectKey, CacheObject] = {}
        self._by_hash: dict[ChunkHash, list[ObjectKey]] = {}  # lists: most hashes have one key
        self._events = itertools.count(1)
        self._heap: list[tuple[tuple[int, ...], int, ObjectKey, int]] = []
        self._entries = itertools.count()
        self.groups: dict[bytes, LockGroup] = {}
        self._groups_by_owner: dict[bytes, set[bytes]] = {}
        self._expiry: list[tuple[float, int, bytes]] = []
        self.locked_chunks = 0
        """Chunks tracked by live lock groups (their memory is bounded by the service)."""
        self._locked_by_owner: dict[bytes, int] = {}

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

    def objects(self) -> Iterable[CacheObject]:
        return self._objects.values()

    def keys_with_hash(self, chunk_hash: ChunkHash) -> list[ObjectKey]:
        return sorted(self._by_hash.get(chunk_hash, ()))

    def reserve(
        self, key: ObjectKey, nbytes: int, origin: str, storer: str, eviction: Eviction
    ) -> CacheObject | None:
        """A new uncommitted object of ``nbytes``, evicting into ``eviction`` to make room.

        ``None`` if the bytes cannot be found without touching locked, pinned or uncommitted
        objects. The key must not exist.
        """
        assert key not in self._objects, key
        placed, offset = self._make_room(nbytes, eviction)
        if not placed:
            return None
        stamp = next(self._events)
        obj = CacheObject(
            key=key,
            nbytes=nbytes,
            offset=offset,
            origin=origin,
            storer=storer,
            inserted=stamp,
            last_access=stamp,
        )
        self._objects[key] = obj
        self._by_hash.setdefault(key.chunk_hash, []).append(key)
        self.used_bytes += obj.footprint
        return obj

    def commit(self, obj: CacheObject) -> None:
        obj.committed = True
        obj.last_access = next(self._events)
        self._mark(obj)

    def remove(self, obj: CacheObject) -> None:
        """Drops an object (an aborted reservation or an eviction victim)."""
        del self._objects[obj.key]
        same_hash = self._by_hash[obj.key.chunk_hash]
        same_hash.remove(obj.key)
        if not same_hash:
            del self._by_hash[obj.key.chunk_hash]
        self.used_bytes -= obj.footprint
        if obj.offset is not None and self.allocator is not None:
            self.allocator.free(obj.offset)
        obj.version = next(self._entries)

    def drop(self, obj: CacheObject, eviction: Eviction) -> int:
        """Removes a committed, unpinned object even if locked; returns the lock units freed."""
        assert obj.committed and obj.pins == 0
        released = 0
        if obj.locks:
            for group in list(self.groups.values()):
                released += self._release_key(group, obj.key)
        eviction.add(obj)
        self.remove(obj)
        return released

    def touch(self, key: ObjectKey, hit: bool = False) -> None:
        """Refreshes an object's recency (``hit``: it also counts as a use for LFU)."""
        obj = self._objects.get(key)
        if obj is not None:
            self.touch_object(obj, hit)

    def touch_object(self, obj: CacheObject, hit: bool = False) -> None:
        obj.last_access = next(self._events)
        if hit:
            obj.hits += 1
        if self.policy.refresh_on_access:
            self._mark(obj)

    def index_bytes(self) -> int:
        """Estimated memory of objects and lock bookkeeping outside the pool."""
        return len(self._objects) * OBJECT_INDEX_BYTES + self.locked_chunks * (
            LOCKED_CHUNK_INDEX_BYTES
        )

    # -----------------------------------------------------------------------------------------
    # Eviction
    # -----------------------------------------------------------------------------------------

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
            eviction.add(victim)
            self.remove(victim)

    def _mark(self, obj: CacheObject) -> None:
        """The object's priority or evictability changed: its old heap entry is stale."""
        obj.version = next(self._entries)
        if obj.evictable:
            entry = (self.policy.priority(obj), next(self._entries), obj.key, obj.version)
            heapq.heappush(self._heap, entry)
            if len(self._heap) > 2 * len(self._objects) + 1024:
                self._compact()

    def _next_victim(self) -> CacheObject | None:
        while self._heap:
            _, _, key, version = heapq.heappop(self._heap)
            self.eviction_work += 1
            obj = self._objects.get(key)
            if obj is not None and obj.version == version and obj.evictable:
                return obj
        return None

    def _compact(self) -> None:
        """Rebuilds the heap from the evictable objects (amortised O(1) per push)."""
        self._heap = [
            (self.policy.priority(obj), next(self._entries), obj.key, obj.version)
            for obj in self._objects.values()
            if obj.evictable
        ]
        heapq.heapify(self._heap)

    # -----------------------------------------------------------------------------------------
    # Lock groups
    # -----------------------------------------------------------------------------------------

    def lock_group(
        self,
        handle: bytes,
        session_id: str,
        owner: bytes,
        space: Space,
        hashes: list[ChunkHash],
        num_readers: int,
        objects: list[CacheObject] | None = None,
    ) -> LockGroup:
        """Takes ``num_readers`` units on every object of ``hashes`` (all committed;
        ``objects``: those objects in chunk-then-rank order, when the caller has them)."""
        now = self.clock()
        world = space.world_size
        group = LockGroup(
            handle=handle,
            session_id=session_id,
            owner=owner,
            space=space,
            hashes=hashes,
            units=array("H", [num_readers]) * (len(hashes) * world),
            taken_at=now,
            expires_at=now + self.read_lock_ttl_s,
            num_units=num_readers * len(hashes) * world,
        )
        if objects is None:
            objects = [self._objects[key] for h in hashes for key in space.keys(h)]
        for obj in objects:
            self._add_locks(obj, num_readers)
        self.groups[handle] = group
        self._groups_by_owner.setdefault(owner, set()).add(handle)
        self.locked_chunks += len(hashes)
        self._locked_by_owner[owner] = self._locked_by_owner.get(owner, 0) + len(hashes)
        heapq.heappush(self._expiry, (group.expires_at, next(self._entries), handle))
        if len(self._expiry) > 2 * len(self.groups) + 1024:
            self._expiry = [(g.expires_at, next(self._entries), h) for h, g in self.groups.items()]
            heapq.heapify(self._expiry)
        return group

    def release_range(self, group: LockGroup, first_chunk: int, last_chunk: int) -> int:
        """Releases every unit on chunks ``[first_chunk, last_chunk)``; returns the units."""
        released = 0
        world = group.space.world_size
        for index in range(max(0, first_chunk), min(last_chunk, len(group.hashes))):
            for rank in range(world):
                released += self._release_units(group, index, rank, None)
        self._maybe_drop_group(group)
        return released

    def release_reader(self, group: LockGroup, keys: Iterable[ObjectKey]) -> int:
        """One reader finished with ``keys`` (a retrieve): one unit each, where held."""
        positions = {h: i for i, h in enumerate(group.hashes)}
        released = 0
        for key in keys:
            index = positions.get(key.chunk_hash)
            if index is not None and group.space.key(key.chunk_hash, key.kv_rank) == key:
                released += self._release_units(group, index, key.kv_rank, 1)
        self._maybe_drop_group(group)
        return released

    def release_group(self, group: LockGroup) -> int:
        """Releases everything the group still holds and forgets it."""
        released = self.release_range(group, 0, len(group.hashes))
        self._forget_group(group)
        return released

    def chunks_held(self, group: LockGroup, first_chunk: int, last_chunk: int) -> int:
        """Chunks in ``[first_chunk, last_chunk)`` on which the group still holds a unit."""
        world = group.space.world_size
        return sum(
            1
            for index in range(max(0, first_chunk), min(last_chunk, len(group.hashes)))
            if any(group.units[index * world : (index + 1) * world])
        )

    def locked_chunks_of(self, owner: bytes) -> int:
        """Chunks held by the live lock groups of client ``owner``."""
        return self._locked_by_owner.get(owner, 0)

    def groups_of(self, owner: bytes) -> list[LockGroup]:
        return [self.groups[h] for h in sorted(self._groups_by_owner.get(owner, ()))]

    def expire_groups(self) -> list[Released]:
        """Releases lock groups whose TTL passed; one :class:`Released` each."""
        now = self.clock()
        released = []
        while self._expiry and self._expiry[0][0] <= now:
            _, _, handle = heapq.heappop(self._expiry)
            group = self.groups.get(handle)
            if group is None or group.expires_at > now:
                continue
            keys = group.keys
            units = self.release_group(group)
            if units:
                released.append(Released(group.session_id, keys, units, now - group.taken_at))
        return released

    def _release_key(self, group: LockGroup, key: ObjectKey) -> int:
        if group.space.key(key.chunk_hash, key.kv_rank) != key:
            return 0
        released = 0
        for index, chunk_hash in enumerate(group.hashes):
            if chunk_hash == key.chunk_hash:
                released += self._release_units(group, index, key.kv_rank, None)
        self._maybe_drop_group(group)
        return released

    def _release_units(self, group: LockGroup, index: int, rank: int, count: int | None) -> int:
        slot = index * group.space.world_size + rank
        held = group.units[slot]
        released = held if count is None else min(count, held)
        if released:
            group.units[slot] = held - released
            group.num_units -= released
            obj = self._objects.get(group.space.key(group.hashes[index], rank))
            if obj is not None:
                self._add_locks(obj, -released)
        return released

    def _add_locks(self, obj: CacheObject, delta: int) -> None:
        was_locked = obj.locks > 0
        obj.locks += delta
        self.num_locks += delta
        if was_locked != (obj.locks > 0):
            self._mark(obj)

    def _maybe_drop_group(self, group: LockGroup) -> None:
        if group.handle in self.groups and group.num_units == 0:
            self._forget_group(group)

    def _forget_group(self, group: LockGroup) -> None:
        if self.groups.pop(group.handle, None) is None:
            return
        self.locked_chunks -= len(group.hashes)
        self._locked_by_owner[group.owner] -= len(group.hashes)
        handles = self._groups_by_owner.get(group.owner)
        if handles is not None:
            handles.discard(group.handle)
            if not handles:
                del self._groups_by_owner[group.owner]
                del self._locked_by_owner[group.owner]

    # -----------------------------------------------------------------------------------------
    # Pins
    # -----------------------------------------------------------------------------------------

    def pin(self, obj: CacheObject) -> None:
        obj.pins += 1
        self.num_pins += 1
        if obj.pins == 1:
            self._mark(obj)

    def unpin(self, key: ObjectKey) -> None:
        obj = self._objects.get(key)
        if obj is not None and obj.pins > 0:
            obj.pins -= 1
            self.num_pins -= 1
            if obj.pins == 0:
                self._mark(obj)

    # -----------------------------------------------------------------------------------------
    # Checks
    # -----------------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        used = sum(obj.footprint for obj in self._objects.values())
        assert used == self.used_bytes, (used, self.used_bytes)
        assert self.used_bytes <= self.capacity_bytes, (self.used_bytes, self.capacity_bytes)
        per_object: dict[ObjectKey, int] = {}
        for group in self.groups.values():
            assert group.num_units == sum(group.units) > 0, group.handle
            world = group.space.world_size
            for index, chunk_hash in enumerate(group.hashes):
                for rank in range(world):
                    key = group.space.key(chunk_hash, rank)
                    count = group.units[index * world + rank]
                    per_object[key] = per_object.get(key, 0) + count
        locks = 0
        pins = 0
        live = {(key, version) for _, _, key, version in self._heap}
        for obj in self._objects.values():
            assert obj.locks == per_object.get(obj.key, 0), (obj.key, obj.locks)
            assert obj.pins >= 0
            locks += obj.locks
            pins += obj.pins
            if obj.evictable:
                assert (obj.key, obj.version) in live, obj.key
        assert locks == self.num_locks, (locks, self.num_locks)
        assert pins == self.num_pins, (pins, self.num_pins)
        assert self.locked_chunks == sum(len(g.hashes) for g in self.groups.values())
        by_owner: dict[bytes, int] = {}
        for group in self.groups.values():
            by_owner[group.owner] = by_owner.get(group.owner, 0) + len(group.hashes)
        assert by_owner == self._locked_by_owner, (by_owner, self._locked_by_owner)
