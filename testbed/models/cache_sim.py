"""The simulated cache: the server's eviction policies replayed over chunk keys, no server.

One cache model for every simulation (the oracle engine, the what-if's policy points): at most
``capacity_chunks`` keys, victims chosen by the server's own priority keys
(:mod:`testbed.core.policies`: LRU, FIFO, LFU) over a lazy heap as ``server.cache`` keeps one,
plus Belady's MIN (:class:`Belady`), a priority key too, whose key is the next use: only a
simulation knows the future. :data:`POLICIES` names them all.

Per request, as the cache server serves it minus locks, bytes and time:

1. its hit is the longest prefix of its keys that is cached, looked up before the request's
   own inserts (a request never hits on itself);
2. then its keys are walked in order, as the server's store does: a cached key is touched (an
   access: LRU refreshes it, LFU counts a use, FIFO ignores it), a missing one inserted,
   evicting the lowest priority while the cache holds ``capacity_chunks`` keys (0 caches
   nothing). With a capacity below one request's chunks, its inserts may evict its own earlier
   chunks (the server's read locks would refuse that; the simulation has none).

Belady evicts the key whose next use (the next request containing it) is farthest away,
never-again first. MIN is optimal for independent accesses under forced insertion and is the
standard reference bound; here a hit needs the whole prefix, so it is an approximation. Ties go
to the deeper chunk: a chunk's next use is never earlier than its parent's, so the cache then
never keeps a chunk whose parent it evicted for a later use.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

from testbed.core import policies as server_policies

INFINITE = "infinite"
"""The cache that never evicts (the upper bound on reuse for a workload and chunk size)."""


class SimulatedObject:
    """One cached key: the fields the server's policies read (``inserted``, ``last_access``,
    ``hits``: one event clock, as ``server.cache`` keeps them) and those Belady reads."""

    __slots__ = ("key", "inserted", "last_access", "hits", "next_use", "depth", "version")
    key: int
    inserted: int
    last_access: int
    hits: int
    """Accesses after the insert (every access of a request's walk is a use)."""
    next_use: int
    """Index of the next request that contains the key (Belady only; else 0)."""
    depth: int
    """The key's chunk position in its request."""
    version: int
    """The clock at its latest heap entry: only that entry is live (the clock never repeats,
    so an entry left from an earlier stay in the cache never matches)."""

    def __init__(self, key: int, stamp: int, depth: int, next_use: int) -> None:
        self.key = key
        self.inserted = self.last_access = self.version = stamp
        self.hits = 0
        self.next_use = next_use
        self.depth = depth


class KeyOrder(Protocol):
    """A policy as the simulated cache uses it: every ``testbed.core.policies`` class is one."""

    @property
    def refresh_on_access(self) -> bool: ...

    def priority(self, obj: SimulatedObject) -> tuple[int, ...]: ...


class Belady:
    """Farthest next use first (never-again first); ties: deeper chunk first, then lower key."""

    name: ClassVar[str] = "belady"
    refresh_on_access: ClassVar[bool] = True

    def priority(self, obj: SimulatedObject) -> tuple[int, ...]:
        return (-obj.next_use, -obj.depth, obj.key)


POLICIES: dict[str, type[KeyOrder] | None] = {
    INFINITE: None,
    **server_policies.POLICIES,
    Belady.name: Belady,
}
"""Every policy a simulation replays, by name: ``infinite`` (``None``: nothing is evicted),
the server's, and Belady."""


@dataclass(frozen=True)
class Replay:
    """What one simulation saw."""

    hit_chunks: list[int]
    """Per request, the leading chunks of its keys that were cached at its lookup."""
    evicted: int
    peak: int
    """Most keys held at any time (never above the capacity)."""


def replay(
    request_keys: Sequence[Sequence[int]],
    policy: str = INFINITE,
    capacity_chunks: int | None = None,
) -> Replay:
    """Replays requests (each one's chunk keys in order) through a ``policy`` cache of
    ``capacity_chunks`` keys. ``infinite`` takes no capacity; the others need one (>= 0)."""
    check_policy(policy, capacity_chunks)
    order = POLICIES[policy]
    cache = SimulatedCache(None if order is None else order(), capacity_chunks)
    uses = next_uses(request_keys) if order is Belady else None
    hits = [
        cache.request(keys, None if uses is None else uses[index])
        for index, keys in enumerate(request_keys)
    ]
    return Replay(hits, cache.evicted, cache.peak)


def check_policy(policy: str, capacity_chunks: int | None) -> None:
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    if policy == INFINITE and capacity_chunks is not None:
        others = ", ".join(name for name in POLICIES if name != INFINITE)
        raise ValueError(
            f"policy {INFINITE!r} takes no capacity_chunks (got {capacity_chunks}); use one "
            f"of {others}"
        )
    if policy != INFINITE and (capacity_chunks is None or capacity_chunks < 0):
        raise ValueError(f"policy {policy!r} needs capacity_chunks >= 0, got {capacity_chunks}")


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
