"""The cache index and allocator on their own (pure Python, no process)."""

from __future__ import annotations

import random

import pytest

from server.cache import Eviction, KVCache, ObjectKey
from server.policies import POLICIES, make_policy
from server.pool import ALIGNMENT, ExtentAllocator


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
    obj = cache.reserve(key(i), nbytes, "", eviction)
    assert obj is not None
    cache.commit(obj)
    return eviction


def test_lru_evicts_the_least_recently_used_unlocked_object():
    cache, _ = make_cache(3 * 128)
    for i in range(3):
        put(cache, i)
    cache.touch(key(0))
    cache.lock("s", b"c", key(1), 1)
    eviction = put(cache, 3)
    assert eviction.keys == [key(2)]
    eviction = put(cache, 4)
    assert eviction.keys == [key(0)]  # 1 is locked
    cache.check_invariants()


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_no_policy_evicts_locked_pinned_or_uncommitted_objects(policy):
    cache, _ = make_cache(4 * 128, policy)
    for i in range(3):
        put(cache, i)
    cache.lock("s", b"c", key(0), 2)
    cache.pin(cache.get(key(1)))
    reserved = cache.reserve(key(9), 100, "", Eviction("capacity"))
    assert reserved is not None
    assert put(cache, 3).keys == [key(2)]
    cache.lock("t", b"c", key(3), 1)
    assert cache.reserve(key(4), 100, "", Eviction("capacity")) is None  # nothing evictable
    assert {k for k in (key(0), key(1), key(9)) if cache.get(k)} == {key(0), key(1), key(9)}
    cache.check_invariants()


def test_fifo_ignores_hits_and_lfu_prefers_rarely_used():
    fifo, _ = make_cache(2 * 128, "fifo")
    put(fifo, 0), put(fifo, 1)
    fifo.touch(key(0))
    assert put(fifo, 2).keys == [key(0)]
    lfu, _ = make_cache(2 * 128, "lfu")
    put(lfu, 0), put(lfu, 1)
    lfu.touch(key(0)), lfu.touch(key(0)), lfu.touch(key(1))
    assert put(lfu, 2).keys == [key(1)]


def test_lock_ttl_and_client_death_release_locks():
    cache, clock = make_cache(10 * 128, ttl=5.0)
    for i in range(3):
        put(cache, i)
    cache.lock("a", b"client-1", key(0), 2)
    clock.now = 3.0
    cache.lock("b", b"client-2", key(1), 1)
    clock.now = 5.5
    (expired,) = cache.expire_locks()
    assert (expired.session_id, expired.keys, expired.num_locks) == ("a", [key(0)], 2)
    assert cache.get(key(0)).locks == 0 and cache.get(key(1)).locks == 1
    (released,) = cache.unlock_client(b"client-2")
    assert released.session_id == "b" and cache.num_locks == 0
    cache.check_invariants()


def test_relocking_extends_the_ttl():
    cache, clock = make_cache(10 * 128, ttl=5.0)
    put(cache, 0)
    cache.lock("a", b"c", key(0), 1)
    clock.now = 4.0
    cache.lock("a", b"c", key(0), 1)
    clock.now = 6.0
    assert cache.expire_locks() == []
    clock.now = 9.5
    (expired,) = cache.expire_locks()
    assert expired.num_locks == 2


def test_metadata_only_accounting_matches_the_pooled_cache():
    rng = random.Random(7)
    pooled, _ = make_cache(20 * 128)
    plain, _ = make_cache(20 * 128, pool=False)
    for _ in range(500):
        i = rng.randrange(60)
        for cache in (pooled, plain):
            if cache.get(key(i)) is None:
                obj = cache.reserve(key(i), 100, "", Eviction("capacity"))
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
