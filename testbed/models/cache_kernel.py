"""The simulated cache's compiled kernel: one pass over a workload's chunk keys as flat arrays.

:mod:`testbed.models.cache_sim` states the model (hit, then walk; victims by priority key);
this module runs it over dense key ids (``np.unique``'s inverse, so comparing ids compares
keys) with per-id state arrays and one lazy binary heap of ``(p0, p1, p2, id, version)``
entries, compared in that order as Python compares the tuples of ``cache_sim``'s heap:

==========  ===========================  ==========================================
policy      priority ``(p0, p1, p2)``    refreshed (a fresh heap entry) on access
==========  ===========================  ==========================================
``lru``     ``(last_access, 0, 0)``      yes
``fifo``    ``(inserted, 0, 0)``         no
``lfu``     ``(hits, last_access, 0)``   yes
``belady``  ``(-next_use, -depth, id)``  yes
==========  ===========================  ==========================================

Only a key's latest entry is live (its version is the clock of that push; the clock never
repeats), and a live entry's priority is the key's current one, so the victim is the live key
of the lowest priority, exactly the one the Python heap pops. The heap is compacted to its live
entries when stale ones outnumber them (memory only: the order is unchanged). Compiled with
numba where importable (the lab extra), else the same code as plain Python.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

try:
    from numba import njit as _njit
except ImportError:  # pragma: no cover - numba comes with the lab extra
    _njit = None

UNLIMITED, LRU, FIFO, LFU, BELADY = -1, 0, 1, 2, 3
"""Policy codes of :func:`run`."""
CODES = {"lru": LRU, "fifo": FIFO, "lfu": LFU, "belady": BELADY}
_SLACK = 1024
"""Stale heap entries tolerated beyond the live ones before the heap is compacted."""


def _compiled(function: Callable[..., Any]) -> Callable[..., Any]:
    return function if _njit is None else _njit(cache=True, nogil=True)(function)


@_compiled
def next_uses(ids: np.ndarray, offsets: np.ndarray, num_ids: int) -> np.ndarray:
    """Per access, the index of the next request that contains its key (one reverse pass);
    the number of requests when it is never used again."""
    num_requests = len(offsets) - 1
    seen = np.full(num_ids, num_requests, dtype=np.int64)
    result = np.empty(len(ids), dtype=np.int64)
    for request in range(num_requests - 1, -1, -1):
        for access in range(offsets[request], offsets[request + 1]):
            result[access] = seen[ids[access]]
        for access in range(offsets[request], offsets[request + 1]):
            seen[ids[access]] = request
    return result


@_compiled
def _less(heap: np.ndarray, i: int, j: int) -> bool:
    for column in range(5):
        if heap[i, column] != heap[j, column]:
            return heap[i, column] < heap[j, column]
    return False


@_compiled
def _swap(heap: np.ndarray, i: int, j: int) -> None:
    for column in range(5):
        heap[i, column], heap[j, column] = heap[j, column], heap[i, column]


@_compiled
def _sift_down(heap: np.ndarray, size: int, position: int) -> None:
    while True:
        child = 2 * position + 1
        if child >= size:
            return
        if child + 1 < size and _less(heap, child + 1, child):
            child += 1
        if not _less(heap, child, position):
            return
        _swap(heap, position, child)
        position = child


@_compiled
def _push(heap: np.ndarray, size: int, p0: int, p1: int, p2: int, key: int, version: int) -> int:
    position = size
    heap[position, 0], heap[position, 1], heap[position, 2] = p0, p1, p2
    heap[position, 3], heap[position, 4] = key, version
    while position > 0:
        parent = (position - 1) // 2
        if not _less(heap, position, parent):
            break
        _swap(heap, position, parent)
        position = parent
    return size + 1


@_compiled
def _pop(heap: np.ndarray, size: int) -> tuple[int, int, int]:
    """Removes the smallest entry: ``(id, version, new size)``."""
    key, version = heap[0, 3], heap[0, 4]
    size -= 1
    for column in range(5):
        heap[0, column] = heap[size, column]
    _sift_down(heap, size, 0)
    return key, version, size


@_compiled
def _compact(heap: np.ndarray, size: int, cached: np.ndarray, versions: np.ndarray) -> int:
    """Keeps the live entries only, as a heap again; returns its size."""
    kept = 0
    for entry in range(size):
        key = heap[entry, 3]
        if cached[key] and versions[key] == heap[entry, 4]:
            for column in range(5):
                heap[kept, column] = heap[entry, column]
            kept += 1
    for position in range(kept // 2 - 1, -1, -1):
        _sift_down(heap, kept, position)
    return kept


@_compiled
def _leading_hits(ids: np.ndarray, cached: np.ndarray, start: int, end: int) -> int:
    """How many of ``ids[start:end]``, from the first, are cached: the request's hit."""
    hit = 0
    while start + hit < end and cached[ids[start + hit]]:
        hit += 1
    return hit


@_compiled
def _priority(policy: int, state: np.ndarray, key: int) -> tuple[int, int, int]:
    """The key's priority; ``state`` columns: inserted, last_access, hits, next_use, depth."""
    if policy == LRU:
        return state[key, 1], 0, 0
    if policy == FIFO:
        return state[key, 0], 0, 0
    if policy == LFU:
        return state[key, 2], state[key, 1], 0
    return -state[key, 3], -state[key, 4], key


@_compiled
def run(
    ids: np.ndarray,
    offsets: np.ndarray,
    num_ids: int,
    policy: int,
    capacity: int,
    uses: np.ndarray,
) -> tuple[np.ndarray, int, int]:
    """Per request its hit (leading cached keys), then its walk; returns (hits, evicted,
    peak). ``uses``: :func:`next_uses` for Belady (else ignored); ``capacity`` is ignored when
    ``policy`` is :data:`UNLIMITED`."""
    num_requests = len(offsets) - 1
    cached = np.zeros(num_ids, dtype=np.bool_)
    hits = np.zeros(num_requests, dtype=np.int64)
    if policy == UNLIMITED:
        held = 0
        for request in range(num_requests):
            start, end = offsets[request], offsets[request + 1]
            hits[request] = _leading_hits(ids, cached, start, end)
            for access in range(start, end):
                if not cached[ids[access]]:
                    cached[ids[access]] = True
                    held += 1
        return hits, 0, held
    longest = 0
    for request in range(num_requests):
        longest = max(longest, offsets[request + 1] - offsets[request])
    heap = np.empty((2 * min(capacity, num_ids) + _SLACK + longest + 2, 5), dtype=np.int64)
    state = np.zeros((num_ids, 5), dtype=np.int64)
    versions = np.zeros(num_ids, dtype=np.int64)
    size = clock = live = evicted = peak = 0
    refresh = policy != FIFO
    for request in range(num_requests):
        start, end = offsets[request], offsets[request + 1]
        hits[request] = _leading_hits(ids, cached, start, end)
        for access in range(start, end):
            clock += 1
            key = ids[access]
            if cached[key]:
                state[key, 1] = clock
                state[key, 2] += 1
                if policy == BELADY:
                    state[key, 3] = uses[access]
                if refresh:
                    versions[key] = clock
                    p0, p1, p2 = _priority(policy, state, key)
                    size = _push(heap, size, p0, p1, p2, key, clock)
                continue
            if capacity == 0:
                continue
            if live < capacity:
                live += 1
                peak = max(peak, live)
            else:
                while True:  # the live entry of the lowest priority
                    victim, version, size = _pop(heap, size)
                    if cached[victim] and versions[victim] == version:
                        break
                cached[victim] = False
                evicted += 1
            cached[key] = True
            state[key, 0] = state[key, 1] = versions[key] = clock
            state[key, 2] = 0
            state[key, 3] = uses[access] if policy == BELADY else 0
            state[key, 4] = access - start
            p0, p1, p2 = _priority(policy, state, key)
            size = _push(heap, size, p0, p1, p2, key, clock)
        if size > 2 * live + _SLACK:
            size = _compact(heap, size, cached, versions)
    return hits, evicted, peak
