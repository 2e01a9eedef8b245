"""The one-pass LRU curve equals the oracle's LRU at every capacity, and the rest follows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from testbed.analysis.whatif import WhatIfOptions, lru_curve, stack_distances, what_if_workload
from testbed.analysis.whatif.sources import servable_requests, workload_traces
from testbed.analysis.whatif.stack import COLD
from testbed.models.access_trace import hashed_trace, keyed_trace
from testbed.models.oracle import simulate, simulate_keys
from testbed.spec.runspec import RunSpec

MOONCAKE_TRACE = (
    Path(__file__).resolve().parents[3].parent / "shared/data/mooncake/conversation_trace.jsonl"
)
needs_trace = pytest.mark.skipif(not MOONCAKE_TRACE.is_file(), reason="no Mooncake trace")

WORKLOADS = [
    ("chat", {"system_prompt_tokens": 128, "question_tokens": [8, 64], "answer_tokens": [8, 64],
              "concurrent_conversations": 6}),
    ("rag", {"num_documents": 30, "document_tokens": [32, 256], "system_prompt_tokens": 64}),
    ("docqa", {"document_tokens": [256, 512], "concurrent_documents": 3}),
]  # fmt: skip


def _trace_of(keys: list[list[int]], chunk_size: int = 4):
    return keyed_trace(chunk_size, keys, [max(1, len(k)) * chunk_size for k in keys])


def test_stack_distances_count_distinct_keys_since_the_last_use_before_the_request():
    # Requests of prefix-chained keys: A, B, then AB' (keys 0 then 2), then A again.
    trace = _trace_of([[0], [1], [0, 2], [0]])
    stack = stack_distances(trace)
    assert stack.distances.tolist() == [COLD, COLD, 2, COLD, 2]
    # The prefix distance is the running maximum: chunk 1 of request 2 is cold.
    assert stack.prefix_distances.tolist() == [COLD, COLD, 2, COLD, 2]
    assert stack.num_distinct_keys == 3
    curve = lru_curve(trace, stack)
    assert [curve.at(c * 4).hit_tokens for c in range(4)] == [0, 0, 8, 8]
    assert curve.at(None).hit_tokens == 8


@pytest.mark.parametrize(("spec", "params"), WORKLOADS)
def test_lru_curve_equals_the_oracle_at_every_capacity(spec, params):
    run = RunSpec(engine="oracle", workload=spec, requests=60, seed=1, workload_params=params)
    requests = servable_requests(run)
    for chunk_size in (32, 64):
        trace = workload_traces(run, [chunk_size])[chunk_size]
        curve = lru_curve(trace, stack_distances(trace))
        keyed = hashed_trace(requests, chunk_size)
        unlimited = simulate_keys(keyed)
        assert curve.at(None).hit_tokens == unlimited.hit_tokens  # exact at unlimited
        assert curve.at(None).token_hit_rate == unlimited.token_hit_rate
        distinct = curve.num_distinct_keys
        for capacity in sorted({0, 1, distinct // 20, distinct // 5, distinct // 2, distinct}):
            oracle = simulate_keys(keyed, "lru", capacity)
            point = curve.at(capacity * chunk_size)
            assert point.hit_tokens == oracle.hit_tokens, (chunk_size, capacity)
            assert point.mean_request_hit_rate == pytest.approx(oracle.mean_request_hit_rate)


@needs_trace
def test_mooncake_keys_from_hash_ids_equal_the_oracles_and_so_does_the_curve():
    run = RunSpec(engine="oracle", workload=f"mooncake:{MOONCAKE_TRACE}", requests=400)
    requests = servable_requests(run)
    sizes = (64, 256, 512, 768)
    traces = workload_traces(run, sizes)
    for chunk_size in sizes:
        fast = traces[chunk_size]
        hashed = hashed_trace(requests, chunk_size)
        expected = hashed.query_keys
        # Same sharing structure: the two keyings name the same partition of the chunks.
        pairs = set(zip(fast.query_keys.tolist(), expected.tolist(), strict=True))
        assert len(pairs) == len(set(expected.tolist())) == len(set(fast.query_keys.tolist()))
        curve = lru_curve(fast, stack_distances(fast))
        for capacity in (50, 400, 2000):
            assert curve.at(capacity * chunk_size).hit_tokens == (
                simulate_keys(hashed, "lru", capacity).hit_tokens
            )
        assert curve.at(None).hit_tokens == simulate(requests, chunk_size).hit_tokens


@needs_trace
def test_mooncake_requests_too_long_for_the_engine_pool_are_left_out_as_a_run_leaves_them():
    run = RunSpec(
        engine="oracle", workload=f"mooncake:{MOONCAKE_TRACE}", requests=300, engine_blocks=160
    )
    requests = servable_requests(run)
    blocks = workload_traces(run, [512])[512]  # keyed from the hash ids
    assert 0 < len(requests) < 300
    assert blocks.prompt_tokens.tolist() == [len(r.prompt_token_ids) for r in requests]
    assert blocks.step_time_s.tolist() == [r.arrival_s for r in requests]


@pytest.mark.parametrize(("spec", "params"), WORKLOADS[:2])
def test_rechunked_curves_equal_the_curves_hashed_at_that_chunk_size(spec, params):
    run = RunSpec(engine="oracle", workload=spec, requests=60, workload_params=params)
    fine = workload_traces(run, [64])[64]
    for chunk_size in (128, 256):
        derived = fine.at_chunk_size(chunk_size)
        direct = workload_traces(run, [chunk_size])[chunk_size]
        a = lru_curve(derived, stack_distances(derived))
        b = lru_curve(direct, stack_distances(direct))
        assert a.num_distinct_keys == b.num_distinct_keys
        assert np.array_equal(a.hit_tokens, b.hit_tokens)
        assert np.allclose(a.rate_sum, b.rate_sum)
    with pytest.raises(ValueError, match="not a multiple"):
        fine.at_chunk_size(96)


def test_minimum_capacity_is_the_smallest_lru_capacity_keeping_the_share():
    run = RunSpec(engine="oracle", workload="chat", requests=80, workload_params=WORKLOADS[0][1])
    trace = workload_traces(run, [32])[32]
    curve = lru_curve(trace, stack_distances(trace))
    unlimited = curve.at(None).hit_tokens
    for fraction in (0.6, 0.9, 0.99):
        tokens = curve.min_capacity_tokens(fraction)
        assert tokens % 32 == 0
        assert simulate_keys(hashed_trace(servable_requests(run), 32), "lru",
                             tokens // 32).hit_tokens >= fraction * unlimited  # fmt: skip
        assert curve.at(tokens - 32).hit_tokens < fraction * unlimited


def test_belady_and_lru_points_are_the_oracles():
    params = WORKLOADS[1][1]
    run = RunSpec(engine="oracle", workload="rag", requests=80, workload_params=params)
    whatif = what_if_workload(
        run,
        WhatIfOptions(chunk_sizes=(64,), policies=("lru", "belady", "fifo", "lfu"),
                      at_tokens=(640, 2560), policy_points=3),
    )  # fmt: skip
    requests = servable_requests(run)
    for policy in ("lru", "belady"):
        for capacity in (640, 2560):
            point = whatif.point(64, capacity, policy)
            oracle = simulate(requests, 64, policy, capacity // 64)
            assert point["hit_tokens"] == oracle.hit_tokens
            assert point["token_hit_rate"] == pytest.approx(oracle.token_hit_rate, abs=1e-12)
    unlimited = whatif.point(64, None, "lru")["hit_tokens"]
    for policy in ("belady", "fifo", "lfu"):
        assert whatif.point(64, None, policy)["hit_tokens"] == unlimited
