"""A two-tier cache hierarchy replayed over chunk keys, no server: every write and promotion
policy, by brute force.

The hierarchy is L1 (the server's shared-memory pool; hit source ``host``) over L2 (a lower
tier; hit source ``disk``), each an LRU cache of a capacity in chunks. Per request, as the
server serves it minus locks, bytes and time:

1. its hit is the longest prefix of its keys held by *some* tier, looked up before the
   request's own writes; each hit chunk is credited to the highest tier holding it at that
   moment (L1 before L2: the server's ``hit_chunks_by_tier``);
2. then its keys are walked in order. A hit chunk served from L1 is touched in every tier
   holding it; one served from L2 is touched there and, under ``tier_promote = "retain"``,
   inserted into L1 (``"none"``: copied up for this load only, L1 unchanged). A chunk past the
   hit is stored: inserted into L1 (touched where already held) and written below by the write
   policy: ``write_through`` at once, ``write_back`` when L1 evicts it, ``selective:N`` once
   it has been hit ``N`` times while in L1.

With ``write_through`` + ``retain`` (the *inclusive* hierarchy) every reference reaches both
tiers, so each holds the most recent keys of one recency stack: Mattson's inclusion, and the
what-if's one pass (:mod:`testbed.analysis.whatif.tiers`) is exact. Every other combination
is what this module is for: simulated per configuration, and labelled so wherever shown.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

HOST = "host"
DISK = "disk"
TIER_SOURCES = (HOST, DISK)
"""Hit-source names of the two tiers (vLLM's), index 0 and 1 of :attr:`TierReplay.hit_tiers`."""
WRITE_THROUGH = "write_through"
WRITE_BACK = "write_back"
SELECTIVE = "selective"
PROMOTE_POLICIES = ("none", "retain")


@dataclass(frozen=True)
class TierPolicy:
    """How chunks move between L1 and L2 (the run keys ``tier_write`` and ``tier_promote``)."""

    write: str = WRITE_THROUGH
    """``write_through``, ``write_back`` or ``selective:N`` (N >= 1 hits)."""
    promote: str = "retain"
    """``retain`` (an L2 hit stays in L1) or ``none`` (copied up for its load only)."""

    def __post_init__(self) -> None:
        _ = self.selective_hits  # validates ``write``
        if self.promote not in PROMOTE_POLICIES:
            raise ValueError(
                f"tier_promote must be one of {', '.join(PROMOTE_POLICIES)}, got {self.promote!r}"
            )

    @property
    def selective_hits(self) -> int | None:
        """``N`` of ``selective:N`` (``None`` for the other write policies)."""
        if self.write in (WRITE_THROUGH, WRITE_BACK):
            return None
        kind, _, count = self.write.partition(":")
        if kind == SELECTIVE and count.isdigit() and int(count) >= 1:
            return int(count)
        raise ValueError(
            f"tier_write must be {WRITE_THROUGH}, {WRITE_BACK} or {SELECTIVE}:N with N >= 1 "
            f"(e.g. selective:2), got {self.write!r}"
        )

    @property
    def inclusive(self) -> bool:
        """Whether one stack pass predicts this hierarchy exactly (write_through + retain)."""
        return self.write == WRITE_THROUGH and self.promote == "retain"

    @property
    def label(self) -> str:
        return f"{self.write}+{self.promote}"


class LRUTier:
    """At most ``capacity`` keys; the least recently used leaves first."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"a tier's capacity must be >= 0 chunks, got {capacity}")
        self.capacity = capacity
        self.keys: OrderedDict[int, int] = OrderedDict()
        """key -> hits while held (``selective:N`` reads them)."""

    def __contains__(self, key: int) -> bool:
        return key in self.keys

    def touch(self, key: int) -> None:
        self.keys.move_to_end(key)

    def put(self, key: int) -> list[int]:
        """Inserts ``key`` (or touches it); returns the keys evicted to make room."""
        if key in self.keys:
            self.keys.move_to_end(key)
            return []
        if self.capacity == 0:
            return []
        evicted = []
        while len(self.keys) >= self.capacity:
            evicted.append(self.keys.popitem(last=False)[0])
        self.keys[key] = 0
        return evicted


@dataclass(frozen=True)
class TierReplay:
    """What one hierarchy simulation saw."""

    hit_tiers: list[list[int]]
    """Per request, per hit chunk (its leading ones), the tier that served it (0 L1, 1 L2)."""
    promotions: int
    """L2 hits inserted into L1 (``retain``)."""
    l2_writes: int
    """Chunks written into L2 (not counting touches of chunks it held)."""
    write_backs: int
    """Of those, chunks written because L1 evicted them (``write_back``)."""

    def tier_chunks(self, tier: int) -> list[int]:
        """Per request, its hit chunks served by ``tier``."""
        return [sum(1 for t in tiers if t == tier) for tiers in self.hit_tiers]


def replay_tiers(
    request_keys: Sequence[Sequence[int]],
    l1_chunks: int,
    l2_chunks: int,
    policy: TierPolicy = TierPolicy(),
) -> TierReplay:
    """Replays requests (each one's chunk keys in order) through the hierarchy."""
    hierarchy = _Hierarchy(LRUTier(l1_chunks), LRUTier(l2_chunks), policy)
    hits = [hierarchy.request(keys) for keys in request_keys]
    return TierReplay(hits, hierarchy.promotions, hierarchy.l2_writes, hierarchy.write_backs)


class _Hierarchy:
    def __init__(self, l1: LRUTier, l2: LRUTier, policy: TierPolicy) -> None:
        self.l1, self.l2, self.policy = l1, l2, policy
        self.selective = policy.selective_hits
        self.promotions = self.l2_writes = self.write_backs = 0

    def request(self, keys: Sequence[int]) -> list[int]:
        l1, l2 = self.l1, self.l2
        tiers: list[int] = []
        for key in keys:
            if key in l1:
                tiers.append(0)
            elif key in l2:
                tiers.append(1)
            else:
                break
        for index, key in enumerate(keys):
            if index < len(tiers):
                self._hit(key, tiers[index])
            else:
                self._store(key)
        return tiers

    def _hit(self, key: int, tier: int) -> None:
        if self.policy.write == WRITE_THROUGH:  # (re)written below: every reference reaches L2
            self._write_l2(key)
        elif key in self.l2:
            self.l2.touch(key)
        if tier == 0:  # the walk may have evicted it since the lookup: then it is put back
            self._put_l1(key)
            if key in self.l1:
                self.l1.keys[key] += 1
                if self.selective is not None and self.l1.keys[key] >= self.selective:
                    self._write_l2(key)
        elif self.policy.promote == "retain":
            self._put_l1(key)
            self.promotions += 1

    def _store(self, key: int) -> None:
        if key in self.l2:
            self.l2.touch(key)
        self._put_l1(key)
        if self.policy.write == WRITE_THROUGH:
            self._write_l2(key)

    def _put_l1(self, key: int) -> None:
        for victim in self.l1.put(key):
            if self.policy.write == WRITE_BACK and victim not in self.l2:
                self._write_l2(victim)
                self.write_backs += 1

    def _write_l2(self, key: int) -> None:
        if key in self.l2:
            self.l2.touch(key)
            return
        self.l2.put(key)
        if key in self.l2:
            self.l2_writes += 1
