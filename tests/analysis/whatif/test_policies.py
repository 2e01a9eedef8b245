"""The simulated cache orders victims exactly as the server's policy classes do."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from testbed.analysis.whatif.sources import servable_requests
from testbed.core.policies import POLICIES, make_policy
from testbed.models.access_trace import hashed_trace
from testbed.models.cache_sim import replay
from testbed.spec.runspec import RunSpec


@dataclass
class _Object:
    """The fields ``testbed.core.policies`` reads (``server.cache.CacheObject`` has them)."""

    inserted: int
    last_access: int
    hits: int = 0


def _with_server_policy(request_keys: list[list[int]], name: str, capacity: int) -> list[int]:
    """The oracle's walk, with ``testbed.core.policies`` ordering every victim: a touch is a hit
    (the request used the chunk), as the server counts a lookup hit."""
    policy = make_policy(name)
    cached: dict[int, _Object] = {}
    clock = itertools.count()
    hits = []
    for keys in request_keys:
        hit = 0
        while hit < len(keys) and keys[hit] in cached:
            hit += 1
        hits.append(hit)
        for key in keys:
            if key in cached:
                cached[key].last_access = next(clock)
                cached[key].hits += 1
            elif capacity > 0:
                if len(cached) >= capacity:
                    del cached[min(cached, key=lambda k: policy.priority(cached[k]))]
                stamp = next(clock)
                cached[key] = _Object(inserted=stamp, last_access=stamp)
    return hits


def test_every_server_policy_evicts_as_the_server_orders_its_victims():
    run = RunSpec(workload="rag", requests=80, workload_params={"num_documents": 25})
    keys = hashed_trace(servable_requests(run), 64).request_keys()
    distinct = len({k for request in keys for k in request})
    for name in POLICIES:
        for capacity in (0, 1, distinct // 10, distinct // 3):
            ours = replay(keys, name, capacity).hit_chunks
            assert ours == _with_server_policy(keys, name, capacity), (name, capacity)


def test_fifo_does_not_refresh_and_lfu_keeps_the_popular_key():
    # One-chunk requests: A B A C A with room for two keys.
    keys = [[0], [1], [0], [2], [0]]
    # FIFO: C evicts A (first in) although A was just used: the last A misses.
    assert replay(keys, "fifo", 2).hit_chunks == [0, 0, 1, 0, 0]
    # LRU: C evicts B; LFU: C evicts B (one use) and keeps A (two): both hit the last A.
    assert replay(keys, "lru", 2).hit_chunks == [0, 0, 1, 0, 1]
    assert replay(keys, "lfu", 2).hit_chunks == [0, 0, 1, 0, 1]
