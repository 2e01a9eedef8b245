"""The simulated cache as it was written in Python before its compiled kernel
(``testbed.models.cache_kernel``): the reference the kernel's results are compared with, hit for
hit, evicted and peak."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from testbed.models import cache_sim
from testbed.models.cache_sim import INFINITE, POLICIES, Belady, KeyOrder, Replay, check_policy


def reference_replay(
    request_keys: Sequence[Sequence[int]],
    policy: str = INFINITE,
    capacity_chunks: int | None = None,
) -> Replay:
    check_policy(policy, capacity_chunks)
    order = POLICIES[policy]
    cache = SimulatedCache(None if order is None else order(), capacity_chunks)
    uses = next_uses(request_keys) if order is Belady else None
    hits = [
        cache.request(keys, None if uses is None else uses[index])
        for index, keys in enumerate(request_keys)
    ]
    return Replay(hits, cache.evicted, cache.peak)


class SimulatedObject(cache_sim.SimulatedObject):
    """One cached key: the fields the server's policies and Belady read (the protocol's), and
    the heap entry's version."""

    __slots__ = ("key", "inserted", "last_access", "hits", "next_use", "depth", "version")
    version: int
    """The clock at its latest heap entry: only that entry is live (the clock never repeats,
    so an entry left from an earlier stay in the cache never matches)."""

    def __init__(self, key: int, stamp: int, depth: int, next_use: int) -> None:
        self.key = key
        self.inserted = self.last_access = self.version = stamp
        self.hits = 0
        self.next_use = next_use
        self.depth = depth


class SimulatedCache:
    """At most ``capacity`` keys (``None``: unlimited), evicted in ``order``'s priority.

    Like ``server.cache``: one lazy heap of ``(priority, key, version)``; an entry is live
    while its key is cached with that version; an access that changes the priority pushes a
    fresh entry; the heap is rebuilt when stale entries outnumber the live ones.
    """

    def __init__(self, order: KeyOrder | None, capacity: int | None) -> None:
        if (order is None) != (capacity is None):
            raise ValueError("an unlimited cache takes no policy, a limited one needs one")
        self.order = order
        self.capacity = capacity
        self.objects: dict[int, SimulatedObject] = {}
        self.evicted = 0
        self.peak = 0
        self._heap: list[tuple[tuple[int, ...], int, int]] = []
        self._clock = 0

    def request(self, keys: Sequence[int], next_uses: Sequence[int] | None = None) -> int:
        """One request: its hit (leading cached keys), then the walk over ``keys``
        (``next_uses``: per key, the next request that contains it, for Belady)."""
        objects = self.objects
        hit = 0
        while hit < len(keys) and keys[hit] in objects:
            hit += 1
        if self.order is None:
            for depth, key in enumerate(keys):
                if key not in objects:
                    objects[key] = SimulatedObject(key, 0, depth, 0)
            self.peak = len(objects)
            return hit
        self._walk(keys, next_uses, self.order)
        return hit

    def _walk(self, keys: Sequence[int], next_uses: Sequence[int] | None, order: KeyOrder) -> None:
        """Touches or inserts each key in turn (the hot loop: locals, no call per eviction;
        an evicted key's object is reused for the key that takes its place)."""
        objects, heap, capacity = self.objects, self._heap, self.capacity
        assert capacity is not None
        priority, refresh = order.priority, order.refresh_on_access
        get, push, pop = objects.get, heapq.heappush, heapq.heappop
        clock, evicted = self._clock, self.evicted
        for depth, key in enumerate(keys):
            clock += 1
            obj = get(key)
            if obj is not None:
                obj.last_access = clock
                obj.hits += 1
                if next_uses is not None:
                    obj.next_use = next_uses[depth]
                if refresh:
                    obj.version = clock
                    push(heap, (priority(obj), key, clock))
                continue
            if capacity == 0:
                continue
            next_use = 0 if next_uses is None else next_uses[depth]
            if len(objects) < capacity:
                obj = SimulatedObject(key, clock, depth, next_use)
                self.peak = max(self.peak, len(objects) + 1)
            else:
                while True:  # the live entry of the lowest priority
                    _, victim, version = pop(heap)
                    obj = get(victim)
                    if obj is not None and obj.version == version:
                        break
                del objects[victim]
                evicted += 1
                obj.key, obj.depth, obj.next_use, obj.hits = key, depth, next_use, 0
                obj.inserted = obj.last_access = obj.version = clock
            objects[key] = obj
            push(heap, (priority(obj), key, clock))
        self._clock, self.evicted = clock, evicted
        if len(heap) > 2 * len(objects) + 1024:
            self._heap = [(priority(o), o.key, o.version) for o in objects.values()]
            heapq.heapify(self._heap)


def next_uses(request_keys: Sequence[Sequence[int]]) -> list[list[int]]:
    """Per request and key, the index of the next request containing that key (one reverse
    pass); ``len(request_keys)`` (later than any request) when it is never used again."""
    never = len(request_keys)
    next_seen: dict[int, int] = {}
    result: list[list[int]] = [[] for _ in request_keys]
    for index in range(len(request_keys) - 1, -1, -1):
        keys = request_keys[index]
        result[index] = [next_seen.get(key, never) for key in keys]
        for key in keys:
            next_seen[key] = index
    return result
