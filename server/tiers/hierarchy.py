"""The hierarchy below L1: which tier holds what, the write, promotion and prefetch policies.

Runs in the cache server process, on its loop (the index's thread); the bytes move on the
tiers' I/O thread (``server.tiers.io``). L1 stays the shared-memory pool and its index
(``server.cache.KVCache``); each tier below it is a store (``server.tiers.base``) with an index
of its own: a metadata-only :class:`~server.cache.KVCache` with the tier's capacity and
eviction policy, in which an object is *reserved* while its write is in flight, *committed*
once written, and *pinned* while it is read (so a tier never evicts what it is reading).

Contracts:

- A worker only copies from or into L1. A lookup that matches chunks below L1 first brings
  them up (:meth:`Hierarchy.prefetch`): their L1 objects are reserved (so they read as
  ``in_flight``), read, verified (``server.tiers.framing``), copied into the pool and
  committed, then pinned until the lookup that asked has locked them (:meth:`claimed`).
  A read that fails or does not verify is a miss (``tier_read_failed``), never bytes served.
- A locked or pinned L1 object is never evicted, so never demoted away; the L1 eviction of an
  object written down under ``write_back`` copies its bytes from the pool before the slot is
  handed to anyone (the server records an eviction before it replies).
- Recency: every access (a hit in any tier, a store) refreshes the object in every tier that
  holds it, so with ``write_through`` + ``retain`` + ``lru`` everywhere L1 is a subset of L2
  and Mattson's stack inclusion holds (the one-pass what-if relies on it).
- Nothing here raises for a tier's failure: it is counted with its cause (``TierStats``).
- Every commit in a tier and every removal from one is recorded in the server's eviction feed
  (``server.eviction_feed``) under the tier's kind, for the clients that announce what each
  tier holds (vLLM KV events with a medium per tier).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from server.cache import KVCache
from server.eviction_feed import EvictionFeed
from server.objects import CacheObject, Eviction, ObjectKey
from server.tiers import spans
from server.tiers.framing import HEADER_BYTES, frame, store_key, unframe
from server.tiers.io import TierIO, TierJob
from server.tiers.policies import PrefetchPolicy, PromoteKind, WritePolicy
from server.tiers.redis_store import shared_sizes
from server.tiers.spec import TierSpec, tier_name
from testbed.core import protocol as p

TIER_PROMOTE = "tier_promote"
"""Chunk log cause of a commit in L1 that a prefetch made (its status: the tier's source)."""
TRANSIENT = "tier_transient"
"""Eviction reason of an object promoted for one load only (``tier_promote = none``)."""


@dataclass(eq=False)
class Tier:
    """One level below L1: its spec, its index, its traffic."""

    spec: TierSpec
    kind: str
    index: KVCache
    stats: p.TierStats

    def fail(self, cause: str | None) -> None:
        self.stats.failures += 1
        name = cause or "io_error"
        self.stats.failures_by_cause[name] = self.stats.failures_by_cause.get(name, 0) + 1


@dataclass(eq=False)
class Prefetch:
    """One object being brought up into L1 for a lookup."""

    l1: CacheObject
    tier: int
    lower: CacheObject
    session_id: str
    parent: str
    claimed: bool = False
    arrived: bool = False


@dataclass
class Settings:
    write: WritePolicy
    promote: PromoteKind
    prefetch: PrefetchPolicy
    max_prefetch_objects: int
    max_queued_writes: int


@dataclass
class Hierarchy:
    """L1's index and pool, the tiers below, their I/O thread, and the policies."""

    l1: KVCache
    pool: np.ndarray | None
    tiers: list[Tier]
    io: TierIO
    settings: Settings
    clock: Callable[[], float] = time.monotonic
    prefetching: dict[ObjectKey, Prefetch] = field(default_factory=dict)
    transient: dict[ObjectKey, CacheObject] = field(default_factory=dict)
    queued_writes: int = 0
    read_failed: dict[ObjectKey, str] = field(default_factory=dict)
    """Objects whose prefetch failed, with the cause, until a lookup reads the cause."""
    promoted: list[tuple[CacheObject, str]] = field(default_factory=list)
    """Objects committed in L1 from a tier (with its hit-source name) since :meth:`pump`
    last returned them (the server logs them as commits)."""
    feed: EvictionFeed | None = None
    """Where the tiers' commits and removals are recorded (the server's eviction feed)."""

    @property
    def enabled(self) -> bool:
        return True

    @property
    def busy(self) -> bool:
        """Whether I/O is in flight (the loop then wakes often to collect it)."""
        return self.io.in_flight > 0

    # -----------------------------------------------------------------------------------------
    # Where an object is
    # -----------------------------------------------------------------------------------------

    def holder(self, keys: Sequence[ObjectKey]) -> int | None:
        """The first tier below L1 holding every one of ``keys`` committed (``None``: none)."""
        for number, tier in enumerate(self.tiers):
            if all(tier.index.committed(key) is not None for key in keys):
                return number
            if self._adopt(number, keys):
                return number
        return None

    def held_below(self, keys: Sequence[ObjectKey]) -> bool:
        """Whether a tier below L1 holds every one of ``keys`` committed, by this server's own
        index (no store is asked)."""
        return any(
            all(tier.index.committed(key) is not None for key in keys) for tier in self.tiers
        )

    def writing(self, keys: Sequence[ObjectKey]) -> bool:
        """Whether a tier below L1 is still writing every one of ``keys`` (reserved there, not
        yet committed): a chunk L1 evicted before its write-through completed is on its way
        into the hierarchy, as a store in flight is into L1."""
        return any(
            all((obj := tier.index.get(key)) is not None and not obj.committed for key in keys)
            for tier in self.tiers
        )

    def _adopt(self, number: int, keys: Sequence[ObjectKey]) -> bool:
        """A shared tier (``store.shared``: a remote store other servers write to) may hold
        objects this index never saw: asked, on the loop, and entered into the index as held
        when it holds every one of ``keys`` (a missing or unreachable one: nothing entered)."""
        tier, store = self.tiers[number], self.io.stores[number]
        unknown = [key for key in keys if tier.index.get(key) is None]
        sizes = shared_sizes(store, [store_key(key) for key in unknown])
        if not unknown or sizes is None or len(unknown) < len(keys):
            return False  # a key being written here: the write, not another server, decides
        eviction = Eviction(reason="capacity")
        adopted = []
        for key, size in zip(unknown, sizes, strict=True):
            lower = tier.index.reserve(key, size - HEADER_BYTES, "", "", eviction)
            if lower is None:
                break
            tier.index.commit(lower)
            adopted.append(lower)
        self._tier_evicted(number, eviction, "")
        self._changed(number, [obj.key for obj in adopted], stored=True)
        tier.stats.adopted += len(adopted)
        return len(adopted) == len(keys)

    def source(self, tier: int) -> str:
        return self.tiers[tier].kind

    def is_prefetching(self, key: ObjectKey) -> bool:
        return key in self.prefetching

    # -----------------------------------------------------------------------------------------
    # Hooks of the server: stores, hits, L1 evictions
    # -----------------------------------------------------------------------------------------

    def stored(self, objects: Iterable[CacheObject], parent: str) -> None:
        """Objects committed in L1 by a store: written down under ``write_through``."""
        for obj in objects:
            self._refresh(obj.key)
            if self.settings.write.kind == "write_through":
                self._write_down(obj, parent, "write_through")

    def hit(self, objects: Iterable[CacheObject], parent: str) -> None:
        """L1 objects a lookup matched: refreshed below; under ``selective:N`` written down
        once hit N times."""
        write = self.settings.write
        for obj in objects:
            self._refresh(obj.key)
            if write.kind == "selective" and obj.hits >= write.min_hits:
                self._write_down(obj, parent, str(write))

    def evicted(self, eviction: Eviction, parent: str) -> None:
        """L1 removed ``eviction``'s objects: demoted under ``write_back`` (their bytes are
        still in the pool: nobody has been handed their slots yet)."""
        for obj in eviction.objects:
            self.transient.pop(obj.key, None)
        if eviction.reason != "capacity" or self.settings.write.kind != "write_back":
            return
        demoted = []
        for obj in eviction.objects:
            tiers = self._write_down(obj, parent, "write_back")
            for number in tiers:
                self.tiers[number].stats.demotions += 1
            if tiers:
                demoted.append(obj)
        spans.demoted(demoted, parent)

    # -----------------------------------------------------------------------------------------
    # Prefetch
    # -----------------------------------------------------------------------------------------

    def prefetch(
        self,
        keys: Sequence[ObjectKey],
        tier: int,
        session_id: str,
        parent: str,
        eviction: Eviction,
    ) -> bool:
        """Starts bringing ``keys`` (one chunk's objects, all held by ``tier``, none in L1)
        into L1, evicting into ``eviction`` (the caller records it); False if it could not
        start (the bound on prefetches in flight, or no room in L1)."""
        if len(self.prefetching) + len(keys) > self.settings.max_prefetch_objects:
            return False
        if self.pool is None:
            return False
        reserved: list[tuple[ObjectKey, CacheObject]] = []
        for key in keys:
            lower = self.tiers[tier].index.committed(key)
            assert lower is not None
            obj = self.l1.reserve(key, lower.nbytes, parent, session_id, eviction)
            if obj is None:
                for _, done in reserved:
                    self.l1.remove(done)
                return False
            reserved.append((key, obj))
        for key, obj in reserved:
            lower = self.tiers[tier].index.committed(key)
            assert lower is not None
            self.tiers[tier].index.pin(lower)
            self.tiers[tier].index.touch_object(lower, hit=True)
            self.prefetching[key] = Prefetch(obj, tier, lower, session_id, parent)
            self.io.submit(TierJob("read", tier, store_key(key), context=key))
        return True

    def claimed(self, objects: Iterable[CacheObject]) -> None:
        """The lookup that asked for these prefetched objects has locked them: the pins the
        prefetch held go (under ``none`` they leave L1 once nothing holds them)."""
        for obj in objects:
            record = self.prefetching.get(obj.key)
            if record is not None and record.arrived and not record.claimed:
                record.claimed = True
                self.l1.unpin(obj.key)
                del self.prefetching[obj.key]
                if self.settings.promote == "none":
                    self.transient[obj.key] = obj

    def release_session(self, session_id: str) -> None:
        """The lookup of ``session_id`` was answered: prefetches it did not claim (they came
        too late, or the hit ended before them) stay in L1 as ordinary objects."""
        for key, record in list(self.prefetching.items()):
            if record.session_id == session_id and record.arrived:
                self.l1.unpin(key)
                del self.prefetching[key]
            elif record.session_id == session_id:
                record.session_id = ""

    # -----------------------------------------------------------------------------------------
    # The loop's share: completions and transient objects
    # -----------------------------------------------------------------------------------------

    def pump(self) -> tuple[list[Eviction], list[tuple[CacheObject, str]]]:
        """Collects finished I/O; returns the L1 removals to record (failed prefetches'
        reservations are aborted silently, transient objects dropped once unheld) and the
        objects promoted into L1 with their tier's hit-source name."""
        for job in self.io.completed():
            if job.kind == "write":
                self._write_done(job)
            elif job.kind == "read":
                self._read_done(job)
        dropped = Eviction(reason=TRANSIENT)
        for key, obj in list(self.transient.items()):
            if self.l1.get(key) is not obj:
                del self.transient[key]
            elif obj.evictable:
                del self.transient[key]
                self.l1.drop(obj, dropped)
        while len(self.read_failed) > self.settings.max_prefetch_objects:  # nobody asked
            del self.read_failed[next(iter(self.read_failed))]
        promoted, self.promoted = self.promoted, []
        return ([dropped] if dropped.objects else []), promoted

    def stats(self) -> list[p.TierStats]:
        for tier in self.tiers:
            tier.stats.used_bytes = tier.index.used_bytes
            tier.stats.num_objects = len(tier.index)
        return [tier.stats for tier in self.tiers]

    def close(self) -> None:
        self.io.close()

    # -----------------------------------------------------------------------------------------
    # Internal
    # -----------------------------------------------------------------------------------------

    def _refresh(self, key: ObjectKey) -> None:
        for tier in self.tiers:
            tier.index.touch(key, hit=True)

    def _write_down(self, obj: CacheObject, parent: str, reason: str) -> list[int]:
        """Queues ``obj``'s bytes for every tier that lacks it; the tiers it was queued for."""
        if self.pool is None or obj.offset is None or obj.key in self.transient:
            return []
        queued = []
        payload: bytes | None = None
        for number, tier in enumerate(self.tiers):
            if tier.index.get(obj.key) is not None:
                continue
            if self.queued_writes >= self.settings.max_queued_writes:
                tier.stats.dropped_writes += 1
                continue
            eviction = Eviction(reason="capacity")
            lower = tier.index.reserve(obj.key, obj.nbytes, parent, obj.storer, eviction)
            self._tier_evicted(number, eviction, parent)
            if lower is None:
                tier.fail("full")
                continue
            if payload is None:
                key = store_key(obj.key)
                payload = frame(key, self.pool[obj.offset : obj.offset + obj.nbytes].data)
            self.queued_writes += 1
            context = (obj.key, reason, parent)
            self.io.submit(TierJob("write", number, store_key(obj.key), payload, context))
            queued.append(number)
        return queued

    def _changed(self, number: int, keys: Iterable[ObjectKey], *, stored: bool) -> None:
        if self.feed is not None:
            self.feed.record(keys, self.tiers[number].kind, stored)

    def _tier_evicted(self, number: int, eviction: Eviction, parent: str) -> None:
        if not eviction.objects:
            return
        tier = self.tiers[number]
        tier.stats.evictions += len(eviction.objects)
        for victim in eviction.objects:
            self.io.submit(TierJob("remove", number, store_key(victim.key)))
        self._changed(number, eviction.keys, stored=False)
        spans.tier_evicted(tier_name(number), tier, eviction, parent)

    def _write_done(self, job: TierJob) -> None:
        self.queued_writes -= 1
        key, reason, parent = job.context
        tier = self.tiers[job.tier]
        lower = tier.index.get(key)
        if lower is None or lower.committed:
            return
        if job.ok:
            tier.index.commit(lower)
            self._changed(job.tier, [key], stored=True)
            tier.stats.writes += 1
            tier.stats.written_bytes += lower.nbytes
            if reason == "write_back":
                tier.stats.write_backs += 1
        else:
            tier.index.remove(lower)
            tier.fail(job.cause)
            self.io.submit(TierJob("remove", job.tier, job.key))
        spans.tier_io(tier_name(job.tier), tier, job, lower.nbytes, reason, parent)

    def _read_done(self, job: TierJob) -> None:
        key: ObjectKey = job.context
        record = self.prefetching.get(key)
        tier = self.tiers[job.tier]
        if record is None:
            return
        tier.index.unpin(key)
        obj = record.l1
        payload = None if job.data is None else unframe(job.key, job.data)
        spans.tier_io(tier_name(job.tier), tier, job, obj.nbytes, "prefetch", record.parent)
        if payload is None or len(payload) != obj.nbytes or self.l1.get(key) is not obj:
            cause = job.cause or "corrupt"
            tier.fail(cause)
            self.read_failed[key] = cause
            del self.prefetching[key]
            if self.l1.get(key) is obj:
                self.l1.remove(obj)
            lower = tier.index.get(key)
            if lower is not None and lower.committed and lower.pins == 0:
                tier.index.remove(lower)  # unreadable: forget it, so no lookup matches it again
                self._changed(job.tier, [key], stored=False)
                self.io.submit(TierJob("remove", job.tier, job.key))
            return
        assert self.pool is not None and obj.offset is not None
        self.pool[obj.offset : obj.offset + obj.nbytes] = np.frombuffer(payload, np.uint8)
        self.l1.commit(obj)
        self.l1.pin(obj)  # held for the lookup that asked (claimed) or released with it
        record.arrived = True
        self.promoted.append((obj, tier.kind))
        tier.stats.reads += 1
        tier.stats.read_bytes += obj.nbytes
        tier.stats.promotions += 1
        spans.promoted(tier_name(job.tier), tier, obj, self.settings.promote, job, record.parent)
        if not record.session_id:
            self.release_session("")
