"""Eviction policies: small strategy classes behind a name.

A policy only orders objects; the cache decides what may go (never a locked, pinned or
uncommitted object) and walks :meth:`EvictionPolicy.candidates` until enough bytes are free.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Hashable, Iterator


class EvictionPolicy(ABC):
    name: str

    @abstractmethod
    def inserted(self, key: Hashable) -> None:
        """A committed object became evictable-in-principle."""

    @abstractmethod
    def accessed(self, key: Hashable) -> None:
        """The object was hit, retrieved or its session ended."""

    @abstractmethod
    def removed(self, key: Hashable) -> None:
        """The object left the cache."""

    @abstractmethod
    def candidates(self) -> Iterator[Hashable]:
        """Keys in eviction order, first victim first.

        The caller must not call the other methods while iterating: it collects its victims
        first and removes them afterwards.
        """


class LRU(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def inserted(self, key: Hashable) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def accessed(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def removed(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def candidates(self) -> Iterator[Hashable]:
        return iter(self._order)


class FIFO(LRU):
    """First inserted first; hits do not refresh."""

    name = "fifo"

    def accessed(self, key: Hashable) -> None:
        return None


class LFU(EvictionPolicy):
    """Least frequently used first; ties broken by least recent use."""

    name = "lfu"

    def __init__(self) -> None:
        self._count: dict[Hashable, int] = {}
        self._stamp: dict[Hashable, int] = {}
        self._heap: list[tuple[int, int, Hashable]] = []
        self._clock = itertools.count()

    def _push(self, key: Hashable) -> None:
        stamp = next(self._clock)
        self._stamp[key] = stamp
        heapq.heappush(self._heap, (self._count[key], stamp, key))

    def inserted(self, key: Hashable) -> None:
        self._count[key] = 1
        self._push(key)

    def accessed(self, key: Hashable) -> None:
        if key in self._count:
            self._count[key] += 1
            self._push(key)

    def removed(self, key: Hashable) -> None:
        self._count.pop(key, None)
        self._stamp.pop(key, None)

    def candidates(self) -> Iterator[Hashable]:
        # Drop stale heap entries (older counts of the same key), then order the live ones.
        live = sorted(entry for entry in self._heap if self._stamp.get(entry[2]) == entry[1])
        self._heap = live  # a sorted list is a valid heap
        return iter([key for _, _, key in live])


POLICIES: dict[str, type[EvictionPolicy]] = {cls.name: cls for cls in (LRU, FIFO, LFU)}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}"
        ) from None
