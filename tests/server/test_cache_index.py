"""The cache index and allocator on their own (pure Python, no process)."""

from __future__ import annotations

import random

import pytest

from server.cache import KVCache
from server.objects import Eviction, ObjectKey, Space
from server.pool import ALIGNMENT, ExtentAllocator
from testbed.core.policies import POLICIES, make_policy


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def key(i: int) -> ObjectKey:
    return ObjectKey("m", 1, 0, i.to_bytes(16, "big"), "")


def make_cache(capacity: int, policy: str = "lru", pool: bool = True, ttl: float = 10.0):
    clock = Clock()
    allocator = ExtentAllocator(capacity) if pool else None
    return KVCache(capacity, make_policy(policy), allocator, clock, ttl), clock


def put(cache: KVCache, i: int, nbytes: int = 100) -> Eviction:
    eviction = Eviction("capacity")
    obj = cache.reserve(key(i), nbytes, "", "", eviction)
    assert obj is not None
    cache.commit(obj)
    return eviction


def lock(cache: KVCache, session: str, owner: bytes, keys: list[ObjectKey], readers: int = 1):
    handle = f"{session}-{len(cache.groups)}".encode()
    hashes = [k.chunk_hash for k in keys]
    return cache.lock_group(handle, session, owner, Space("m", 1, ""), hashes, readers)


def test_lru_evicts_the_least_recently_used_unlocked_object():
    cache, _ = make_cache(3 * 128)
    for i in range(3):
        put(cache, i)
    cache.touch(key(0))
    lock(cache, "s", b"c", [key(1)])
    eviction = put(cache, 3)
    assert eviction.keys == [key(2)]
    eviction = put(cache, 4)
    assert eviction.keys == [key(0)]  # 1 is locked
    cache.check_invariants()


def test_a_key_dropped_and_stored_again_is_not_evicted_by_its_old_heap_entry():
    """A dropped object's heap entry stays behind (lazy deletion); the object stored again
    under the same key must not match it, or it goes first whatever the policy says."""
    cache, _ = make_cache(3 * 128)
    put(cache, 0)
    put(cache, 1)
    assert cache.drop(cache.get(key(0)), Eviction("drop")) == 0
    put(cache, 2)
    put(cache, 0)  # again: the most recently used now
    eviction = put(cache, 3)
    assert eviction.keys == [key(1)]  # the least recently used, not the new 0
    cache.check_invariants()


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_no_policy_evicts_locked_pinned_or_uncommitted_objects(policy):
    cache, _ = make_cache(4 * 128, policy)
    for i in range(3):
        put(cache, i)
    lock(cache, "s", b"c", [key(0)], readers=2)
    cache.pin(cache.get(key(1)))
    reserved = cache.reserve(key(9), 100, "", "", Eviction("capacity"))
    assert reserved is not None
    assert put(cache, 3).keys == [key(2)]
    lock(cache, "t", b"c", [key(3)])
    assert cache.reserve(key(4), 100, "", "", Eviction("capacity")) is None  # nothing evictable
    assert {k for k in (key(0), key(1), key(9)) if cache.get(k)} == {key(0), key(1), key(9)}
    cache.check_invariants()


def test_an_object_unlocked_or_unpinned_becomes_evictable_again():
    cache, _ = make_cache(2 * 128)
    put(cache, 0), put(cache, 1)
    group = lock(cache, "s", b"c", [key(0), key(1)])
    assert cache.reserve(key(2), 100, "", "", Eviction("capacity")) is None
    cache.release_range(group, 1, 2)  # key(1) only
    assert put(cache, 2).keys == [key(1)]
    cache.pin(cache.get(key(2)))
    cache.release_group(group)
    assert put(cache, 3).keys == [key(0)]
    cache.unpin(key(2))
    assert put(cache, 4).keys == [key(2)]
    cache.check_invariants()


def test_fifo_ignores_hits_and_lfu_prefers_rarely_used():
    fifo, _ = make_cache(2 * 128, "fifo")
    put(fifo, 0), put(fifo, 1)
    fifo.touch(key(0), hit=True)
    assert put(fifo, 2).keys == [key(0)]
    lfu, _ = make_cache(2 * 128, "lfu")
    put(lfu, 0), put(lfu, 1)
    lfu.touch(key(0), hit=True), lfu.touch(key(0), hit=True), lfu.touch(key(1), hit=True)
    assert put(lfu, 2).keys == [key(1)]


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_examines_a_bounded_number_of_heap_entries_per_eviction(policy):
    """Per-eviction cost without a stopwatch: heap entries examined by victim selection.
    A policy that sorted every object per victim would examine ~n entries per eviction."""
    n = 100_000
    cache, _ = make_cache(n * 128, policy, pool=False)
    for i in range(n):
        put(cache, i)
    rng = random.Random(5)
    for i in rng.sample(range(n), n // 2):  # hits reorder LRU and LFU
        cache.touch(key(i), hit=True)
    for i in rng.sample(range(n), 1000):  # locked objects are skipped, never evicted
        lock(cache, f"s{i}", b"c", [key(i)])
    before = cache.eviction_work
    evictions = 0
    for i in range(n, n + 20_000):
        evictions += len(put(cache, i).objects)
    work_per_eviction = (cache.eviction_work - before) / evictions
    assert evictions == 20_000
    assert work_per_eviction < 4, work_per_eviction
    cache.check_invariants()


def test_lock_ttl_and_a_clients_groups_release_locks():
    cache, clock = make_cache(10 * 128, ttl=5.0)
    for i in range(3):
        put(cache, i)
    lock(cache, "a", b"client-1", [key(0)], readers=2)
    clock.now = 3.0
    lock(cache, "b", b"client-2", [key(1)])
    clock.now = 5.5
    (expired,) = cache.expire_groups()
    assert (expired.session_id, expired.keys, expired.num_locks) == ("a", [key(0)], 2)
    assert cache.get(key(0)).locks == 0 and cache.get(key(1)).locks == 1
    (group,) = cache.groups_of(b"client-2")
    assert cache.release_group(group) == 1 and cache.num_locks == 0
    cache.check_invariants()


def test_released_lock_groups_leave_no_expiry_bookkeeping_behind():
    cache, _ = make_cache(10 * 128, ttl=300.0)
    for i in range(3):
        put(cache, i)
    for round_ in range(5000):  # the same session's lookup, released, over and over
        group = lock(cache, f"s{round_ % 3}", b"c", [key(0), key(1), key(2)])
        cache.release_group(group)
    assert len(cache.groups) == 0 and cache.num_locks == 0
    assert len(cache._expiry) <= 1024 + 2 * len(cache.groups)
    cache.check_invariants()


def test_a_reader_releases_one_unit_of_its_own_objects():
    cache, _ = make_cache(10 * 128)
    # Two ranks per chunk, two chunks, two readers per object (TP=2 with MLA-like readers).
    space = Space("m", 2, "")
    rank = {(h, r): space.key(h, r) for h in (b"a" * 16, b"b" * 16) for r in (0, 1)}
    for k in rank.values():
        obj = cache.reserve(k, 100, "", "", Eviction("capacity"))
        cache.commit(obj)
    group = cache.lock_group(b"h", "s", b"c", space, [b"a" * 16, b"b" * 16], 2)
    assert cache.num_locks == 8
    mine = [rank[(b"a" * 16, 0)], rank[(b"b" * 16, 0)]]  # rank 0's objects
    assert cache.release_reader(group, mine) == 2
    assert cache.get(mine[0]).locks == 1 and cache.get(rank[(b"a" * 16, 1)]).locks == 2
    assert cache.release_reader(group, mine) == 2
    assert cache.release_reader(group, mine) == 0  # nothing left to release
    assert cache.release_range(group, 0, 2) == 4
    assert b"h" not in cache.groups
    cache.check_invariants()


def test_metadata_only_accounting_matches_the_pooled_cache():
    rng = random.Random(7)
    pooled, _ = make_cache(20 * 128)
    plain, _ = make_cache(20 * 128, pool=False)
    for _ in range(500):
        i = rng.randrange(60)
        for cache in (pooled, plain):
            if cache.get(key(i)) is None:
                obj = cache.reserve(key(i), 100, "", "", Eviction("capacity"))
                if obj is not None:
                    cache.commit(obj)
            else:
                cache.touch(key(i))
        assert sorted(o.key for o in pooled.objects()) == sorted(o.key for o in plain.objects())
        assert pooled.used_bytes == plain.used_bytes <= 20 * 128
    pooled.check_invariants()


def test_allocator_reuses_and_coalesces_extents():
    allocator = ExtentAllocator(10 * ALIGNMENT)
    offsets = [allocator.allocate(ALIGNMENT) for _ in range(10)]
    assert offsets == [i * ALIGNMENT for i in range(10)]
    assert allocator.allocate(1) is None
    for offset in offsets[2:6]:
        allocator.free(offset)
    assert allocator.allocate(4 * ALIGNMENT) == 2 * ALIGNMENT  # four neighbours merged
    allocator.free(2 * ALIGNMENT)
    assert allocator.allocate(3 * ALIGNMENT) == 2 * ALIGNMENT
    assert allocator.allocate(ALIGNMENT) == 5 * ALIGNMENT
    for offset in (0, ALIGNMENT, 2 * ALIGNMENT, 5 * ALIGNMENT, *offsets[6:]):
        allocator.free(offset)
    assert allocator.allocated_bytes == 0
    assert allocator.allocate(10 * ALIGNMENT) == 0  # everything merged back


def test_allocator_never_overlaps_under_random_use():
    rng = random.Random(3)
    allocator = ExtentAllocator(64 * 1024)
    live: dict[int, int] = {}
    for _ in range(3000):
        if live and rng.random() < 0.45:
            offset = rng.choice(list(live))
            allocator.free(offset)
            del live[offset]
            continue
        size = rng.choice([64, 200, 1000, 4096])
        offset = allocator.allocate(size)
        if offset is None:
            continue
        end = offset + size
        for other, other_size in live.items():
            assert end <= other or other + other_size <= offset
        assert end <= allocator.size
        live[offset] = size
