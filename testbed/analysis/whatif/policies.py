"""Other eviction policies at sampled capacities, one simulation per capacity.

Only LRU has a one-pass curve (:mod:`.stack`); Belady (MIN), FIFO and LFU are simulated with
the oracle's semantics over each request's first-lookup keys: look up the cached prefix, then
walk the keys (a cached key is touched, a missing one inserted, evicting while the cache holds
``capacity_chunks`` keys). ``lru`` and ``belady`` *are* the oracle
(:func:`testbed.models.oracle.simulate_keys`); ``fifo`` and ``lfu`` order victims as the
server's policies do (``testbed/core/policies.py``):

- ``fifo``: first inserted goes first; touches do not refresh;
- ``lfu``: fewest uses goes first (an insert counts one, each touch one more), ties to the least
  recently used.

For a run the keys are what its first lookups asked for; the server also touched chunks on
stores, retrieves and session ends, which these simulations leave out (LFU counts differ).
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict

import numpy as np

from testbed.models.oracle import KeyTrace, simulate_keys

POLICIES = ("lru", "belady", "fifo", "lfu")
"""Policies a what-if can simulate beside the LRU curve."""


def simulate_policy(trace: KeyTrace, policy: str, capacity_chunks: int) -> np.ndarray:
    """Leading hit chunks per request of ``trace`` under ``policy`` at ``capacity_chunks``."""
    if capacity_chunks < 0:
        raise ValueError(f"capacity_chunks must be >= 0, got {capacity_chunks}")
    if policy in ("lru", "belady"):
        result = simulate_keys(trace, policy, capacity_chunks)
        return np.asarray(result.per_request_hit_tokens, dtype=np.int64) // trace.chunk_size
    cache: _FIFO | _LFU
    if policy == "fifo":
        cache = _FIFO(capacity_chunks)
    elif policy == "lfu":
        cache = _LFU(capacity_chunks)
    else:
        raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    hits = np.zeros(len(trace.keys), dtype=np.int64)
    for index, keys in enumerate(trace.keys):
        hit = 0
        while hit < len(keys) and keys[hit] in cache:
            hit += 1
        hits[index] = hit
        for key in keys:
            if key in cache:
                cache.touch(key)
            else:
                cache.insert(key)
    return hits


class _FIFO:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._order: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, key: int) -> bool:
        return key in self._order

    def touch(self, key: int) -> None:
        return None

    def insert(self, key: int) -> None:
        if self.capacity == 0:
            return
        if len(self._order) >= self.capacity:
            self._order.popitem(last=False)
        self._order[key] = None


class _LFU:
    """A heap of (uses, stamp, key) with lazy deletion: an entry is live while its stamp is the
    key's latest."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._uses: dict[int, int] = {}
        self._stamp: dict[int, int] = {}
        self._heap: list[tuple[int, int, int]] = []
        self._clock = itertools.count()

    def __contains__(self, key: int) -> bool:
        return key in self._uses

    def touch(self, key: int) -> None:
        self._uses[key] += 1
        self._push(key)

    def insert(self, key: int) -> None:
        if self.capacity == 0:
            return
        if len(self._uses) >= self.capacity:
            self._evict_one()
        self._uses[key] = 1
        self._push(key)

    def _push(self, key: int) -> None:
        stamp = next(self._clock)
        self._stamp[key] = stamp
        heapq.heappush(self._heap, (self._uses[key], stamp, key))

    def _evict_one(self) -> None:
        while True:
            _, stamp, key = heapq.heappop(self._heap)
            if self._stamp.get(key) == stamp:
                del self._uses[key], self._stamp[key]
                return
