"""Cost of one eviction per policy as the cache grows, LRU the baseline of the same run.

For each object count ``N`` a cache per policy (``server.cache.KVCache``, metadata only: no
pool, the index alone) is filled with ``N`` objects; half of them are hit once (so LRU and LFU
reorder) and 1,000 are locked (so victim selection must skip them). Then every policy inserts
new objects in interleaved batches, each insert evicting one object, and the time per
eviction is the batch time over the evictions it caused. Time that stays flat from 10^5 to
10^6 objects, and LFU and FIFO close to LRU, is the ``O(log n)`` of the lazy heap (the
previous LFU sorted every entry per victim: 3.5 ms per eviction at 20,000 objects).

    python -m testbed.bench.eviction [--objects 100000 1000000] [--batches 10] [--batch 2000]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from server.cache import KVCache
from server.objects import Eviction, ObjectKey, Space
from testbed.bench.tables import table
from testbed.core.keys import HASH_BYTES, ChunkHash
from testbed.core.policies import POLICIES, make_policy

OBJECT_BYTES = 4096


def _key(index: int) -> ObjectKey:
    return ObjectKey("bench", 1, 0, ChunkHash(index.to_bytes(HASH_BYTES, "big")), "")


def _insert(cache: KVCache, index: int) -> int:
    """Stores one new object; the number of objects it evicted."""
    eviction = Eviction("capacity")
    obj = cache.reserve(_key(index), OBJECT_BYTES, "", "", eviction)
    assert obj is not None, "the benchmark cache is full of locked objects"
    cache.commit(obj)
    return len(eviction.objects)


def filled_cache(policy: str, num_objects: int, seed: int) -> KVCache:
    """A full cache of ``num_objects``, half of them hit once, 1,000 locked."""
    cache = KVCache(num_objects * OBJECT_BYTES, make_policy(policy), None, time.monotonic, 3600.0)
    for index in range(num_objects):
        _insert(cache, index)
    rng = random.Random(seed)
    for index in rng.sample(range(num_objects), num_objects // 2):
        cache.touch(_key(index), hit=True)
    space = Space("bench", 1, "")
    for index in rng.sample(range(num_objects), min(1000, num_objects // 10)):
        handle = f"lock-{index}".encode()
        cache.lock_group(handle, "s", b"bench", space, [_key(index).chunk_hash], 1)
    return cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--objects", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--batch", type=int, default=2000, help="inserts per timed batch")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    policies = sorted(POLICIES)
    rows = []
    for num_objects in args.objects:
        caches = {name: filled_cache(name, num_objects, args.seed) for name in policies}
        per_eviction: dict[str, list[float]] = {name: [] for name in policies}
        work: dict[str, int] = {name: 0 for name in policies}
        evicted: dict[str, int] = {name: 0 for name in policies}
        next_index = num_objects
        for _ in range(args.batches):  # interleaved: the machine's noise hits every policy
            for name in policies:
                cache = caches[name]
                before = cache.eviction_work
                started = time.perf_counter()
                count = sum(_insert(cache, next_index + i) for i in range(args.batch))
                elapsed = time.perf_counter() - started
                work[name] += cache.eviction_work - before
                evicted[name] += count
                per_eviction[name].append(elapsed / max(count, 1))
            next_index += args.batch
        baseline = statistics.median(per_eviction["lru"])
        for name in policies:
            median = statistics.median(per_eviction[name])
            rows.append(
                (
                    f"{num_objects:,}",
                    name,
                    f"{median * 1e6:.2f}",
                    f"{max(per_eviction[name]) * 1e6:.2f}",
                    f"{work[name] / max(evicted[name], 1):.2f}",
                    f"{median / baseline:.2f}x",
                )
            )
        del caches
    print(
        f"one insert that evicts one object, {args.batches} interleaved batches of "
        f"{args.batch} per policy (insert + eviction, µs)"
    )
    print(
        table(
            rows,
            ("objects", "policy", "p50 µs", "max µs", "heap entries / eviction", "vs lru"),
        )
    )


if __name__ == "__main__":
    main()
