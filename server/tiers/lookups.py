"""What a lookup does with the tiers below L1: send for the chunks they hold (a prefetch),
say why the hit ended at a chunk between tiers, and credit each hit chunk to its tier.

Runs in the cache server process, inside the lookup handler (``server.sessions``), on the
loop. A chunk counts as matched in the tier that held it when the lookup first matched it
(``PendingLookup.from_tier``), even once its prefetch has brought it into L1.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence

from server.context import Call, Shared
from server.objects import CacheObject, Eviction, Space
from server.state import PendingLookup
from server.tiers import spans
from server.tiers.base import L1_SOURCE
from testbed.core.keys import ChunkHash
from testbed.core.protocol import Lookup, MissStatus

PREFETCH_TIMEOUT: MissStatus = "prefetch_timeout"
"""Miss status: the chunk was on its way up from a lower tier when the lookup was answered."""
TIER_READ_FAILED: MissStatus = "tier_read_failed"
"""Miss status: the chunk's read from a lower tier failed (or did not verify)."""
LOGGED_STATUSES = frozenset({PREFETCH_TIMEOUT, TIER_READ_FAILED})
"""Miss statuses the chunk log's lookup rows carry (the run's token causes read them)."""


def prefetch(s: Shared, call: Call, pending: PendingLookup) -> Generator[None, None, None]:
    """Sends for the lookup's chunks after its L1 prefix that a lower tier holds, in order,
    until a chunk no tier holds (or the bound on prefetches, or no room in L1), once the
    chunks of the hit that L1 holds are refreshed (:func:`_refresh_l1_hits`); lowers the
    lookup's deadline to the prefetch policy's wait when it sent for any."""
    req = pending.request
    tiers = s.tiers
    space = Space(req.model, req.world_size, req.cache_salt)
    eviction = Eviction(reason="capacity")
    pending.unsent = None
    _refresh_l1_hits(s, space, req.chunk_hashes)
    started: dict[str, int] = {}
    nbytes = 0
    for chunk_hash in req.chunk_hashes:
        keys = space.keys(chunk_hash)
        objects = [s.cache.get(key) for key in keys]
        if all(obj is not None and obj.committed for obj in objects):
            continue
        if any(obj is not None for obj in objects):
            if not all(tiers.is_prefetching(key) for key in keys):
                break  # a store in flight: the lookup waits for it as without tiers
            record = tiers.prefetching[keys[0]]
            pending.from_tier.setdefault(chunk_hash, tiers.source(record.tier))
            continue
        tier = tiers.holder(keys)
        if tier is None:
            break
        if not tiers.prefetch(keys, tier, req.session_id, call.traceparent, eviction):
            pending.unsent = chunk_hash
            break
        source = tiers.source(tier)
        pending.from_tier[chunk_hash] = source
        started[source] = started.get(source, 0) + 1
        nbytes += sum(tiers.prefetching[key].l1.nbytes for key in keys)
        if call.spend(req.world_size):
            yield
    s.record_eviction(eviction, call.traceparent)
    if started:
        policy = tiers.settings.prefetch
        wait_s = policy.wait_s(s.config.lookup_pending_timeout_s)
        pending.deadline = min(pending.deadline, s.clock() + wait_s)
        spans.prefetch_started(call.traceparent, req.session_id, started, nbytes, str(policy))


def _refresh_l1_hits(s: Shared, space: Space, chunk_hashes: Sequence[ChunkHash]) -> None:
    """Refreshes the chunks of the lookup's hit that L1 already holds, before any prefetch
    makes room in L1: the room is then taken from objects this lookup does not need, never
    from its own L1 hits (which nothing locks until the lookup is answered). As the stack
    sees a lookup: its hit chunks are all referenced at once, before anything is brought in.
    A chunk a lower tier is still writing (L1 evicted it before its write-through completed)
    does not end the refresh: the lookup waits for it (:func:`writing_below`) and brings it
    up on a later poll, and meanwhile its prefetches must not evict the L1 hits after it."""
    held: list[CacheObject] = []
    for chunk_hash in chunk_hashes:
        keys = space.keys(chunk_hash)
        objects = [s.cache.get(key) for key in keys]
        if all(obj is not None and obj.committed for obj in objects):
            held.extend(obj for obj in objects if obj is not None)
        elif any(obj is not None for obj in objects) or (
            s.tiers.holder(keys) is None and not s.tiers.writing(keys)
        ):
            break  # a store in flight or a chunk no tier holds: the hit ends here
    for obj in held:
        s.cache.touch_object(obj)


def writing_below(s: Shared, req: Lookup, hit: int) -> bool:
    """Whether the chunk that ends a hit of ``hit`` chunks is absent from L1 only because a
    tier below is still writing it (L1 evicted it before its write-through completed): the
    lookup then waits for it as for a store in flight, and its next poll brings it up."""
    if not s.tiers.enabled or hit >= len(req.chunk_hashes):
        return False
    space = Space(req.model, req.world_size, req.cache_salt)
    return s.tiers.writing(space.keys(req.chunk_hashes[hit]))


def tier_miss_status(
    s: Shared, pending: PendingLookup, space: Space, chunk_hash: ChunkHash, status: MissStatus
) -> MissStatus:
    """``status`` of the chunk that ended the hit, refined by the tiers (and counted):
    ``prefetch_timeout`` if it is still on its way up (or could not be sent for),
    ``tier_read_failed`` if its read failed."""
    keys = space.keys(chunk_hash)
    if chunk_hash == pending.unsent or any(s.tiers.is_prefetching(key) for key in keys):
        s.counters.prefetch_timeouts += 1
        return PREFETCH_TIMEOUT
    failed = [s.tiers.read_failed.pop(key, None) for key in keys]
    if any(cause is not None for cause in failed):
        s.counters.tier_read_failures += 1
        return TIER_READ_FAILED
    return status


def logged_statuses(
    s: Shared, pending: PendingLookup, space: Space, statuses: list[str], miss_status: str
) -> list[str]:
    """The lookup rows' statuses with the tiers' losses named: the chunk that ended the hit
    takes ``miss_status`` when it is one of :data:`LOGGED_STATUSES`, and so does each chunk
    after it that was matched below L1 and not brought in (on its way up, or not sent for:
    no room in L1, the bound on prefetches), up to the first chunk that is neither."""
    if miss_status not in LOGGED_STATUSES:
        return statuses
    hashes = pending.request.chunk_hashes
    hit = next(i for i, status in enumerate(statuses) if status != "hit")
    logged = list(statuses)
    logged[hit] = miss_status
    unsent = hashes[hit] == pending.unsent
    for position in range(hit + 1, len(hashes)):
        keys = space.keys(hashes[position])
        unsent = unsent or hashes[position] == pending.unsent
        if logged[position] == "hit":
            continue
        if any(s.tiers.is_prefetching(key) for key in keys):
            logged[position] = PREFETCH_TIMEOUT
        elif any(key in s.tiers.read_failed for key in keys):
            logged[position] = TIER_READ_FAILED
        elif unsent and s.tiers.held_below(keys):
            logged[position] = PREFETCH_TIMEOUT
        else:
            break
    return logged


def hit_sources(pending: PendingLookup, hashes: Sequence[ChunkHash]) -> dict[str, int]:
    """Hit source -> chunks of the hit ``hashes`` matched there (sums to ``len(hashes)``)."""
    counts: dict[str, int] = {}
    for chunk_hash in hashes:
        source = pending.from_tier.get(chunk_hash, L1_SOURCE)
        counts[source] = counts.get(source, 0) + 1
    return counts
