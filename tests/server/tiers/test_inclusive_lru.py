"""An inclusive LRU hierarchy (write_through + retain + lru in both tiers) on a real server
gives exactly Mattson's stack prediction: a chunk at reuse distance d (distinct chunks since
its last access, itself included) hits L1 if d <= C1, else the disk tier if d <= C2, else
misses. The one-pass what-if over tiers relies on this."""

from __future__ import annotations

import random

from testbed.core.keys import chunk_hashes
from tests.support.cache_harness import connect
from tests.support.quiescence import assert_quiescent
from tests.support.tier_flows import OBJECT_BYTES, C, Worker, lookup, stats, until

C1, C2 = 3, 6


def predicted(accesses: list[int]) -> list[str]:
    """Where each access hits by its stack distance: ``host``, ``disk`` or ``miss``."""
    stack: list[int] = []
    where = []
    for chunk in accesses:
        distance = stack.index(chunk) + 1 if chunk in stack else None
        if distance is None:
            where.append("miss")
        else:
            where.append("host" if distance <= C1 else "disk" if distance <= C2 else "miss")
            stack.remove(chunk)
        stack.insert(0, chunk)
    return where


def inclusive_lru(start_server, tmp_path):
    """A server with room for C1 chunks in L1 over a disk tier with room for C2, inclusive."""
    return start_server(
        "--chunk-size", str(C),
        "--capacity", str(C1 * OBJECT_BYTES),
        "--tier", f"disk:{C2 * OBJECT_BYTES}:{tmp_path / 'l2'}",
        "--tier-promote", "retain",
        "--lookup-pending-timeout", "30",
    )  # fmt: skip


def test_hits_by_tier_equal_the_stack_prediction(start_server, tmp_path):
    server = inclusive_lru(start_server, tmp_path)
    rng = random.Random(7)
    accesses = [rng.randrange(9) for _ in range(80)]
    hashes = [chunk_hashes([chunk * 1000 + i for i in range(C)], C) for chunk in range(9)]
    seen = []
    writes = 0
    with Worker(server) as worker, connect(server, role="scheduler") as scheduler:
        for number, chunk in enumerate(accesses):
            reply = lookup(scheduler, f"r{number}", hashes[chunk])
            if reply.hit_chunks:
                (source,) = reply.hit_chunks_by_tier
                seen.append(source)
                continue
            seen.append("miss")
            worker.store(f"r{number}", hashes[chunk])
            writes += 1
            until(scheduler, lambda s, n=writes: s.tiers[0].writes == n)
        assert_quiescent(stats(scheduler))
    expected = predicted(accesses)
    assert seen == expected
    assert {"host", "disk", "miss"} <= set(expected)  # the sequence exercises every outcome


def test_a_lookup_keeps_its_own_l1_hits_while_it_brings_the_rest_up(start_server, tmp_path):
    # L1 holds the last two chunks of a three-chunk prefix, the disk tier all three: the
    # prefetch of the first one takes its L1 room from another chunk (the least recent one
    # the lookup does not need), never from the lookup's own L1 hits; as the stack predicts,
    # two chunks hit L1 and one the disk.
    server = inclusive_lru(start_server, tmp_path)
    prefix = chunk_hashes(list(range(3 * C)), C)
    other = chunk_hashes([10**6 + i for i in range(C)], C)
    with Worker(server) as worker, connect(server, role="scheduler") as scheduler:
        for number, (hashes, writes) in enumerate([(prefix, 3), (other, 4)]):
            assert lookup(scheduler, f"s{number}", hashes).hit_chunks == 0
            worker.store(f"s{number}", hashes)
            until(scheduler, lambda s, n=writes: s.tiers[0].writes == n)
        reply = lookup(scheduler, "again", prefix)
        assert reply.hit_chunks == 3
        assert reply.hit_chunks_by_tier == {"host": 2, "disk": 1}
