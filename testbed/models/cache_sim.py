"""The simulated cache: the server's eviction policies replayed over chunk keys, no server.

One cache model for every simulation (the oracle engine, the what-if's policy points): at most
``capacity_chunks`` keys, victims chosen by the server's own priority keys
(:mod:`testbed.core.policies`: LRU, FIFO, LFU) over a lazy heap as ``server.cache`` keeps one
(run compiled, over flat key arrays: :mod:`testbed.models.cache_kernel`, which encodes each
priority key as numbers), plus Belady's MIN (:class:`Belady`), a priority key too, whose key
is the next use: only a simulation knows the future. :data:`POLICIES` names them all.

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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

import numpy as np

from testbed.core import policies as server_policies

INFINITE = "infinite"
"""The cache that never evicts (the upper bound on reuse for a workload and chunk size)."""


class SimulatedObject(Protocol):
    """The fields a priority key reads of one cached key (``inserted``, ``last_access``,
    ``hits``: one event clock, as ``server.cache`` keeps them; ``next_use``, ``depth``:
    Belady's)."""

    key: int
    inserted: int
    last_access: int
    hits: int
    """Accesses after the insert (every access of a request's walk is a use)."""
    next_use: int
    """Index of the next request that contains the key (Belady only; else 0)."""
    depth: int
    """The key's chunk position in its request."""


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
    offsets = np.zeros(len(request_keys) + 1, dtype=np.int64)
    np.cumsum([len(keys) for keys in request_keys], out=offsets[1:])
    keys = np.fromiter(
        (key for keys in request_keys for key in keys), dtype=np.int64, count=int(offsets[-1])
    )
    return replay_flat(keys, offsets, policy, capacity_chunks)


def replay_flat(
    keys: np.ndarray,
    offsets: np.ndarray,
    policy: str = INFINITE,
    capacity_chunks: int | None = None,
) -> Replay:
    """:func:`replay` over flat arrays: request ``r``'s keys are ``keys[offsets[r]:offsets[r+1]]``
    (int64), run by the compiled kernel (:mod:`testbed.models.cache_kernel`, imported here:
    numba is heavy, and the policy names of this module are read at every command's start)."""
    from testbed.models import cache_kernel

    check_policy(policy, capacity_chunks)
    if policy != INFINITE and policy not in cache_kernel.CODES:
        raise ValueError(f"policy {policy!r} has no code in the simulated cache's kernel")
    unique, ids = np.unique(np.asarray(keys, dtype=np.int64), return_inverse=True)
    ids = ids.astype(np.int64).ravel()  # ids in key order: comparing ids compares keys
    offsets = np.asarray(offsets, dtype=np.int64)
    code = cache_kernel.UNLIMITED if policy == INFINITE else cache_kernel.CODES[policy]
    uses = (
        cache_kernel.next_uses(ids, offsets, len(unique))
        if code == cache_kernel.BELADY
        else np.empty(0, dtype=np.int64)
    )
    hits, evicted, peak = cache_kernel.run(
        ids, offsets, len(unique), code, capacity_chunks or 0, uses
    )
    return Replay(hits.tolist(), int(evicted), int(peak))


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
