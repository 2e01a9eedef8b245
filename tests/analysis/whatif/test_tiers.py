"""The one-pass tier what-if equals a brute-force hierarchy simulation at every capacity pair."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from testbed.analysis.whatif import stack_distances
from testbed.analysis.whatif.sources import workload_traces
from testbed.analysis.whatif.tiers import (
    ONE_PASS,
    SIMULATED,
    TierGrid,
    one_pass_tiers,
    simulated_tiers,
    tier_table,
)
from testbed.models.access_trace import keyed_trace
from testbed.models.tier_sim import TierPolicy
from testbed.spec.runspec import RunSpec

DATA = Path(__file__).resolve().parents[3].parent / "shared/data"
MOONCAKE_TRACE = DATA / "mooncake/conversation_trace.jsonl"
AGENTIC_TRACES = DATA / "kv-cache-tester"
needs_traces = pytest.mark.skipif(
    not MOONCAKE_TRACE.is_file() or not AGENTIC_TRACES.is_dir(), reason="no shared traces"
)


def _lru_hierarchy(keys: list[list[int]], c1: int, c2: int) -> list[tuple[int, int]]:
    """Brute force, written apart from the module under test: two lists in recency order, every
    reference moves the key to the front of both; per request (L1 chunks, L2 chunks) hit."""
    l1: list[int] = []
    l2: list[int] = []
    hits = []
    for request in keys:
        served = []
        for key in request:
            if key in l1:
                served.append(1)
            elif key in l2:
                served.append(2)
            else:
                break
        hits.append((served.count(1), served.count(2)))
        for key in request:
            for tier, capacity in ((l1, c1), (l2, c2)):
                if key in tier:
                    tier.remove(key)
                if capacity > 0:
                    tier.insert(0, key)
                    del tier[capacity:]
    return hits


def _random_keys(seed: int, requests: int = 60) -> list[list[int]]:
    """Prefix-chained keys: each request extends a random earlier one or starts afresh."""
    rng = np.random.default_rng(seed)
    chains: list[list[int]] = []
    next_key = 0
    for _ in range(requests):
        base = list(chains[rng.integers(len(chains))]) if chains and rng.random() < 0.8 else []
        base = base[: rng.integers(len(base) + 1)]
        for _ in range(rng.integers(1, 6)):
            base.append(next_key)
            next_key += 1
        chains.append(base)
    return chains


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_one_pass_equals_brute_force_lru_hierarchy_on_small_traces(seed):
    keys = _random_keys(seed)
    chunk = 4
    trace = keyed_trace(chunk, keys, [len(k) * chunk + 1 for k in keys])
    stack = stack_distances(trace)
    distinct = len({k for r in keys for k in r})
    for c1, c2 in itertools.product([0, 1, 3, 8, 20], [0, 2, 8, 30, distinct]):
        host, disk = one_pass_tiers(trace, stack, c1 * chunk, c2 * chunk)
        expected = _lru_hierarchy(keys, c1, max(c1, c2))
        assert np.rint(host).astype(int).tolist() == [h * chunk for h, _ in expected], (c1, c2)
        assert np.rint(disk).astype(int).tolist() == [d * chunk for _, d in expected], (c1, c2)
        sim_host, sim_disk = simulated_tiers(trace, c1 * chunk, max(c1, c2) * chunk, TierPolicy())
        assert np.array_equal(sim_host, host) and np.array_equal(sim_disk, disk), (c1, c2)


def test_a_second_tier_turns_l1_misses_into_disk_hits_and_nothing_else():
    # A B A with room for one chunk in L1 and two in the hierarchy: the second A is a disk hit.
    trace = keyed_trace(4, [[0], [1], [0]], [5, 5, 5])
    host, disk = one_pass_tiers(trace, stack_distances(trace), 4, 8)
    assert host.tolist() == [0, 0, 0] and disk.tolist() == [0, 0, 4]
    host, disk = one_pass_tiers(trace, stack_distances(trace), 8, 8)
    assert host.tolist() == [0, 0, 4] and disk.tolist() == [0, 0, 0]


def test_promotion_none_leaves_a_disk_hit_out_of_l1_and_write_back_fills_l2_on_eviction():
    keys = [[0], [1], [0], [0]]
    trace = keyed_trace(4, keys, [5] * 4)
    # retain: the third request promotes A, the fourth hits it in L1.
    host, disk = simulated_tiers(trace, 4, 8, TierPolicy("write_through", "retain"))
    assert host.tolist() == [0, 0, 0, 4] and disk.tolist() == [0, 0, 4, 0]
    # none: A stays on disk only, so the fourth request is a disk hit again.
    host, disk = simulated_tiers(trace, 4, 8, TierPolicy("write_through", "none"))
    assert host.tolist() == [0, 0, 0, 0] and disk.tolist() == [0, 0, 4, 4]
    # write_back: B's store evicts A from L1, which writes it to L2: still a disk hit.
    host, disk = simulated_tiers(trace, 4, 8, TierPolicy("write_back", "none"))
    assert disk.tolist() == [0, 0, 4, 4]
    # selective:2: A was never hit in L1 before B evicted it, so L2 never had it.
    host, disk = simulated_tiers(trace, 4, 8, TierPolicy("selective:2", "retain"))
    assert host.tolist() == [0, 0, 0, 4] and disk.tolist() == [0, 0, 0, 0]


def test_bad_tier_policies_say_what_to_write():
    with pytest.raises(ValueError, match="selective:N"):
        TierPolicy("selective:0")
    with pytest.raises(ValueError, match="tier_promote"):
        TierPolicy("write_through", "keep")


@needs_traces
@pytest.mark.parametrize(
    "workload",
    [f"mooncake:{MOONCAKE_TRACE}", f"agentic:{AGENTIC_TRACES}"],
    ids=["mooncake", "agentic"],
)
def test_one_pass_equals_the_simulated_inclusive_hierarchy_on_real_traces(workload):
    run = RunSpec(engine="oracle", workload=workload, requests=300)
    trace = workload_traces(run, [256])[256]
    stack = stack_distances(trace)
    distinct = stack.num_distinct_keys
    l1 = [distinct // 50 * 256, distinct // 10 * 256]
    l2 = [distinct // 5 * 256, distinct // 2 * 256]
    inclusive = tier_table(trace, stack, TierGrid(tuple(l1), tuple(l2), belady=False))
    assert (inclusive["method"] == ONE_PASS).all()
    for row in inclusive.to_dict("records"):
        host, disk = simulated_tiers(
            trace, row["l1_capacity_tokens"], row["l2_capacity_tokens"], TierPolicy()
        )
        assert row["host_hit_tokens"] == int(host.sum())
        assert row["disk_hit_tokens"] == int(disk.sum())
    assert inclusive["disk_hit_tokens"].sum() > 0  # the second tier bought something here
    grid = TierGrid((l1[0],), (l2[0],), (TierPolicy(), TierPolicy("write_back", "none")))
    table = tier_table(trace, stack, grid)
    assert table.set_index("tier_write")["method"].to_dict() == {
        "write_through": ONE_PASS,
        "write_back": SIMULATED,
    }
    assert (table["belady_hit_tokens"] >= table["hit_tokens"]).all()
