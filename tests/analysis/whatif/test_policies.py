"""FIFO and LFU simulations order victims exactly as the server's policy classes do."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from testbed.analysis.whatif.policies import simulate_policy
from testbed.analysis.whatif.sources import servable_requests
from testbed.core.policies import make_policy
from testbed.models.oracle import KeyTrace
from testbed.runspec import RunSpec


@dataclass
class _Object:
    """The fields ``testbed.core.policies`` reads (``server.cache.CacheObject`` has them)."""

    inserted: int
    last_access: int
    hits: int = 0


def _with_server_policy(trace: KeyTrace, name: str, capacity: int) -> list[int]:
    """The oracle's walk, with ``testbed.core.policies`` ordering every victim: a touch is a hit
    (the request used the chunk), as the server counts a lookup hit."""
    policy = make_policy(name)
    cached: dict[int, _Object] = {}
    clock = itertools.count()
    hits = []
    for keys in trace.keys:
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


def test_fifo_and_lfu_match_the_servers_policies():
    run = RunSpec(workload="rag", requests=80, workload_params={"num_documents": 25})
    trace = KeyTrace.from_requests(servable_requests(run), 64)
    distinct = len({k for keys in trace.keys for k in keys})
    for name in ("fifo", "lfu"):
        for capacity in (0, 1, distinct // 10, distinct // 3):
            ours = simulate_policy(trace, name, capacity)
            assert np.array_equal(ours, _with_server_policy(trace, name, capacity)), (
                name,
                capacity,
            )


def test_fifo_does_not_refresh_and_lfu_keeps_the_popular_key():
    # One-chunk requests: A B A C A with room for two keys.
    trace = KeyTrace(4, [[0], [1], [0], [2], [0]], [4] * 5)
    # FIFO: C evicts A (first in) although A was just used: the last A misses.
    assert simulate_policy(trace, "fifo", 2).tolist() == [0, 0, 1, 0, 0]
    # LRU: C evicts B; LFU: C evicts B (one use) and keeps A (two): both hit the last A.
    assert simulate_policy(trace, "lru", 2).tolist() == [0, 0, 1, 0, 1]
    assert simulate_policy(trace, "lfu", 2).tolist() == [0, 0, 1, 0, 1]
