"""Eviction policies: small priority-key classes behind a name (SGLang's ``evict_policy.py``).

A policy only says how to order objects: :meth:`EvictionPolicy.priority` gives the key of an
object's current state, lowest evicted first. The cache (``server.cache``) keeps one lazy heap
of the evictable objects' keys, pushing a fresh entry whenever an object's priority or its
evictability changes, so every policy costs O(log n) per eviction. The cache alone decides
what may go: never a locked, pinned or uncommitted object.

Priorities use the cache's monotonic event counter (``inserted``, ``last_access``), so keys
are unique and never compare the objects themselves.
"""

from __future__ import annotations

from typing import ClassVar, Protocol


class PolicyState(Protocol):
    """What a policy may read of an object (``server.objects.CacheObject`` provides it)."""

    inserted: int
    last_access: int
    hits: int


class EvictionPolicy:
    name: ClassVar[str]
    refresh_on_access: ClassVar[bool] = True
    """Whether an access changes the priority (FIFO: no; the cache then pushes nothing)."""

    def priority(self, obj: PolicyState) -> tuple[int, ...]:
        raise NotImplementedError


class LRU(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def priority(self, obj: PolicyState) -> tuple[int, ...]:
        return (obj.last_access,)


class FIFO(EvictionPolicy):
    """First inserted first; hits do not refresh."""

    name = "fifo"
    refresh_on_access = False

    def priority(self, obj: PolicyState) -> tuple[int, ...]:
        return (obj.inserted,)


class LFU(EvictionPolicy):
    """Least frequently used first; ties broken by least recent use."""

    name = "lfu"

    def priority(self, obj: PolicyState) -> tuple[int, ...]:
        return (obj.hits, obj.last_access)


POLICIES: dict[str, type[EvictionPolicy]] = {cls.name: cls for cls in (LRU, FIFO, LFU)}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; choose one of {', '.join(sorted(POLICIES))}"
        ) from None
