"""The simulated cache's compiled kernel gives, hit for hit, what the Python cache it replaced
gave (``reference_cache_sim``), for every policy and capacity, on random and real workloads."""

from __future__ import annotations

import numpy as np
import pytest

from testbed.models.cache_sim import INFINITE, POLICIES, replay
from tests.models.reference_cache_sim import reference_replay

LIMITED = [name for name in POLICIES if name != INFINITE]


def _prefix_workload(seed: int, requests: int = 300) -> list[list[int]]:
    """Requests whose keys are prefix chains over a few shared stems (as chunk hashes are):
    reuse, divergence and one-off tails, with keys of either sign."""
    rng = np.random.default_rng(seed)
    stems = [rng.integers(-(2**62), 2**62, size=40).tolist() for _ in range(12)]
    workload = []
    for _ in range(requests):
        stem = stems[int(rng.zipf(1.3)) % len(stems)]
        shared = int(rng.integers(0, len(stem)))
        own = rng.integers(-(2**62), 2**62, size=int(rng.integers(0, 6))).tolist()
        workload.append(stem[:shared] + own)
    return workload


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("policy", LIMITED)
def test_every_policy_at_every_capacity_gives_what_the_python_cache_gave(seed, policy):
    workload = _prefix_workload(seed)
    for capacity in (0, 1, 3, 17, 64, 200, 10_000):
        assert replay(workload, policy, capacity) == reference_replay(workload, policy, capacity), (
            capacity
        )


def test_the_unlimited_cache_gives_what_the_python_cache_gave():
    for seed in (0, 1):
        workload = [*_prefix_workload(seed), [], [5, 5, 5]]  # empty and repeated keys too
        assert replay(workload) == reference_replay(workload)


def test_a_key_repeated_inside_a_request_is_walked_as_before():
    workload = [[1, 2, 1, 3], [3, 1], [2, 2, 2], [1, 2, 3, 4]]
    for policy in LIMITED:
        for capacity in (0, 1, 2, 3):
            assert replay(workload, policy, capacity) == reference_replay(
                workload, policy, capacity
            ), (policy, capacity)


def test_an_agentic_workload_gives_what_the_python_cache_gave(tmp_path):
    from pathlib import Path

    from testbed.models.access_trace import hashed_trace
    from testbed.workloads import make_workload

    traces = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "kv-cache-tester"
    if not traces.is_dir():
        pytest.skip("no kv-cache-tester traces")
    requests = list(
        make_workload(f"agentic:{traces}", num_requests=None,
                      params={"max_sessions": 2, "max_input_tokens": 30_000})
    )  # fmt: skip
    keys = hashed_trace(requests, 256).request_keys()
    distinct = len({key for request in keys for key in request})
    for policy in LIMITED:
        for capacity in (distinct // 10, distinct // 2):
            assert replay(keys, policy, capacity) == reference_replay(keys, policy, capacity)


def test_flat_request_keys_are_the_request_keys():
    from dataclasses import replace

    from testbed.models.access_trace import keyed_trace

    steps = [[3, 1, 4], [], [1, 5], [9, 2, 6, 5], [7]]
    trace = keyed_trace(4, steps, prompt_tokens=[16, 0, 8, 16, 4])
    later = replace(trace, step_request=np.array([0, -1, 2, -1, 1]))  # steps of no request
    for each in (trace, later):
        keys, offsets = each.request_key_arrays()
        flat = [keys[offsets[r] : offsets[r + 1]].tolist() for r in range(each.num_requests)]
        assert flat == each.request_keys()
    assert trace.request_keys() == steps
