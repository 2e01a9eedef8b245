"""The oracle engine: cache hit bounds from prefix-hash arithmetic alone (no server, no vLLM).

Mirrors what the cache server does with one request, minus locks, bytes and time:

1. its keys are ``chunk_hashes(prompt, chunk_size)`` (complete chunks only; the partial tail
   is never stored and never hits; with the request's LoRA adapter and multimodal inputs);
2. its hit is the longest prefix of those keys that is cached;
3. then its keys are walked in order, as the server's store does: a cached key is touched
   (recency refresh), a missing one is inserted, evicting as the policy says while the cache
   holds ``capacity_chunks`` keys.

Policies (:data:`POLICIES`):

- ``infinite``: never evicts (the upper bound on reuse for the workload and chunk size).
- ``lru``: evicts the least recently touched key (the server's default policy).
- ``belady``: evicts the cached key whose next use (the next request containing it) is farthest
  away, never-again first (Belady's MIN). MIN is optimal for independent accesses under forced
  insertion and is the standard reference bound; here a hit needs the whole prefix, so it is an
  approximation. Ties go to the deeper chunk: a chunk's next use is never earlier than its
  parent's, so the cache then never keeps a chunk whose parent it evicted for a later use.

Lookups see the cache as it was before the request's own inserts, so a request never hits on
itself. With ``capacity_chunks`` smaller than one request's chunks, its inserts may evict its
own earlier chunks (the server's read locks would refuse that; the oracle has none).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from testbed.core.keys import KeyExtras, chunk_hashes

# -------------------------------------------------------------------------------------------
# Public
# -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OracleResult:
    policy: str
    """``"infinite"``, ``"lru"`` or ``"belady"``."""
    capacity_chunks: int | None
    """Most keys the cache holds (``None``: infinite)."""
    requests: int
    prompt_tokens: int
    """All prompt tokens, partial tail chunks included."""
    hit_tokens: int
    """Sum over requests of matched complete chunks x chunk_size."""
    token_hit_rate: float
    """``hit_tokens / prompt_tokens`` (0.0 for no requests)."""
    mean_request_hit_rate: float
    """Mean over requests of hit tokens / prompt tokens (0.0 for no requests)."""
    per_request_hit_tokens: list[int]
    evicted_chunks: int
    chunk_size: int
    peak_cached_chunks: int
    """Most keys held at any time (never above ``capacity_chunks``)."""


class HashedRequest(Protocol):
    """What :meth:`KeyTrace.from_requests` reads of a request (a workload request)."""

    @property
    def prompt_token_ids(self) -> Sequence[int] | np.ndarray: ...
    @property
    def key_extras(self) -> KeyExtras | None: ...


@dataclass(frozen=True)
class KeyTrace:
    """A workload reduced to what the oracle needs: each request's chunk keys and length.

    Keys are small ints (one per distinct chunk hash), so a sweep over policies and capacities
    hashes the workload once (:meth:`from_requests`) and simulates many times
    (:func:`simulate_keys`).
    """

    chunk_size: int
    keys: list[list[int]]
    """Per request, its complete chunks' keys in order (equal ints = equal chunk hashes)."""
    prompt_tokens: list[int]
    """Per request, its prompt length in tokens."""

    @classmethod
    def from_requests(cls, requests: Iterable[HashedRequest], chunk_size: int) -> KeyTrace:
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        ids: dict[bytes, int] = {}
        keys: list[list[int]] = []
        prompt_tokens: list[int] = []
        for request in requests:
            hashes = chunk_hashes(request.prompt_token_ids, chunk_size, extras=request.key_extras)
            keys.append([ids.setdefault(h, len(ids)) for h in hashes])
            prompt_tokens.append(len(request.prompt_token_ids))
        return cls(chunk_size, keys, prompt_tokens)


def simulate(
    requests: Iterable[HashedRequest],
    chunk_size: int,
    policy: str = "infinite",
    capacity_chunks: int | None = None,
) -> OracleResult:
    """Replays ``requests`` in order through a ``policy`` cache of ``capacity_chunks`` keys.

    ``infinite`` takes no capacity; ``lru`` and ``belady`` need one (>= 0; 0 caches nothing).
    """
    _check_policy(policy, capacity_chunks)
    return simulate_keys(KeyTrace.from_requests(requests, chunk_size), policy, capacity_chunks)


def simulate_keys(
    trace: KeyTrace, policy: str = "infinite", capacity_chunks: int | None = None
) -> OracleResult:
    """:func:`simulate` over an already hashed workload."""
    _check_policy(policy, capacity_chunks)
    next_uses = _next_uses(trace.keys) if policy == "belady" else None
    cache = POLICIES[policy](capacity_chunks)
    per_request_hit_tokens: list[int] = []
    for index, keys in enumerate(trace.keys):
        hit = 0
        while hit < len(keys) and keys[hit] in cache:
            hit += 1
        per_request_hit_tokens.append(hit * trace.chunk_size)
        for depth, key in enumerate(keys):
            next_use = next_uses[index][depth] if next_uses is not None else 0
            if key in cache:
                cache.touch(key, next_use, depth)
            else:
                cache.insert(key, next_use, depth)
    prompt_tokens = sum(trace.prompt_tokens)
    hit_tokens = sum(per_request_hit_tokens)
    rates = [
        hit / total for hit, total in zip(per_request_hit_tokens, trace.prompt_tokens, strict=True)
    ]
    return OracleResult(
        policy=policy,
        capacity_chunks=capacity_chunks,
        requests=len(trace.keys),
        prompt_tokens=prompt_tokens,
        hit_tokens=hit_tokens,
        token_hit_rate=hit_tokens / prompt_tokens if prompt_tokens else 0.0,
        mean_request_hit_rate=sum(rates) / len(rates) if rates else 0.0,
        per_request_hit_tokens=per_request_hit_tokens,
        evicted_chunks=cache.evicted,
        chunk_size=trace.chunk_size,
        peak_cached_chunks=cache.peak,
    )


# -------------------------------------------------------------------------------------------
# Internal: policies
# -------------------------------------------------------------------------------------------


class _Infinite:
    """Keeps everything. ``next_use`` and ``depth`` are ignored."""

    def __init__(self, capacity_chunks: int | None) -> None:
        self._keys: set[int] = set()
        self.evicted = 0
        self.peak = 0

    def __contains__(self, key: int) -> bool:
        return key in self._keys

    def touch(self, key: int, next_use: int, depth: int) -> None:
        return None

    def insert(self, key: int, next_use: int, depth: int) -> None:
        self._keys.add(key)
        self.peak = max(self.peak, len(self._keys))


class _LRU:
    """Least recently touched or inserted key goes first."""

    def __init__(self, capacity_chunks: int | None) -> None:
        assert capacity_chunks is not None
        self.capacity = capacity_chunks
        self._order: OrderedDict[int, None] = OrderedDict()
        self.evicted = 0
        self.peak = 0

    def __contains__(self, key: int) -> bool:
        return key in self._order

    def touch(self, key: int, next_use: int, depth: int) -> None:
        self._order.move_to_end(key)

    def insert(self, key: int, next_use: int, depth: int) -> None:
        if self.capacity == 0:
            return
        if len(self._order) >= self.capacity:
            self._order.popitem(last=False)
            self.evicted += 1
        self._order[key] = None
        self.peak = max(self.peak, len(self._order))


class _Belady:
    """Farthest next use goes first (deeper chunk on ties); a heap with lazy deletion.

    A key's heap entries go stale when it is touched (its next use moves later) or evicted;
    an entry is live while the key is cached with that same next use.
    """

    def __init__(self, capacity_chunks: int | None) -> None:
        assert capacity_chunks is not None
        self.capacity = capacity_chunks
        self._next_use: dict[int, int] = {}
        self._heap: list[tuple[int, int, int]] = []  # (-next use, -depth, key): farthest on top
        self.evicted = 0
        self.peak = 0

    def __contains__(self, key: int) -> bool:
        return key in self._next_use

    def touch(self, key: int, next_use: int, depth: int) -> None:
        self._next_use[key] = next_use
        heapq.heappush(self._heap, (-next_use, -depth, key))

    def insert(self, key: int, next_use: int, depth: int) -> None:
        if self.capacity == 0:
            return
        if len(self._next_use) >= self.capacity:
            self._evict_one()
        self.touch(key, next_use, depth)
        self.peak = max(self.peak, len(self._next_use))

    def _evict_one(self) -> None:
        while True:
            negative_next_use, _, key = heapq.heappop(self._heap)
            if self._next_use.get(key) == -negative_next_use:
                del self._next_use[key]
                self.evicted += 1
                return


POLICIES: dict[str, type[_Infinite] | type[_LRU] | type[_Belady]] = {
    "infinite": _Infinite,
    "lru": _LRU,
    "belady": _Belady,
}
"""Policy name -> cache model (see the module docstring)."""


def _check_policy(policy: str, capacity_chunks: int | None) -> None:
    if policy not in POLICIES:
        raise ValueError(f"unknown oracle policy {policy!r}; choose one of {', '.join(POLICIES)}")
    if policy == "infinite" and capacity_chunks is not None:
        raise ValueError(
            f"policy 'infinite' takes no capacity_chunks (got {capacity_chunks}); use lru or belady"
        )
    if policy != "infinite" and (capacity_chunks is None or capacity_chunks < 0):
        raise ValueError(f"policy {policy!r} needs capacity_chunks >= 0, got {capacity_chunks}")


def _next_uses(keys: list[list[int]]) -> list[list[int]]:
    """Per request and key, the index of the next request containing that key (one reverse
    pass); ``len(keys)`` (later than any request) when it is never used again."""
    never = len(keys)
    next_seen: dict[int, int] = {}
    result: list[list[int]] = [[] for _ in keys]
    for index in range(len(keys) - 1, -1, -1):
        request_keys = keys[index]
        result[index] = [next_seen.get(key, never) for key in request_keys]
        for key in request_keys:
            next_seen[key] = index
    return result
