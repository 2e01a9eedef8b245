"""The oracle engine: known answers per policy, bounds between policies, the Mooncake trace."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from testbed.models.access_trace import hashed_trace
from testbed.models.oracle import simulate, simulate_keys
from testbed.workloads import WorkloadRequest, make_workload

MOONCAKE_TRACE = (
    Path(__file__).resolve().parents[2].parent / "shared/data/mooncake/conversation_trace.jsonl"
)
C = 4  # chunk size of the hand-made workloads


def _request(index: int, chunks: str, tail_tokens: int = 0) -> WorkloadRequest:
    """A prompt of one C-token chunk per letter (plus a partial tail): chunk keys are prefix
    paths, so "AB" and "XB" share no key."""
    tokens = [ord(letter) for letter in chunks for _ in range(C)] + [1] * tail_tokens
    return WorkloadRequest(f"r{index}", np.array(tokens, dtype=np.int32), 1, float(index))


def _workload(*prompts: str) -> list[WorkloadRequest]:
    return [_request(i, chunks) for i, chunks in enumerate(prompts)]


def test_infinite_cache_hits_the_longest_cached_prefix_of_complete_chunks():
    requests = [
        _request(0, "ABC", tail_tokens=2),
        _request(1, "ABD"),
        _request(2, "ABCE"),
        _request(3, "XBC"),
    ]
    result = simulate(requests, C)
    assert result.per_request_hit_tokens == [0, 2 * C, 3 * C, 0]
    assert (result.requests, result.prompt_tokens, result.hit_tokens) == (
        4,
        14 + 12 + 16 + 12,
        5 * C,
    )
    assert result.token_hit_rate == 20 / 54
    assert result.mean_request_hit_rate == pytest.approx((0 + 8 / 12 + 12 / 16 + 0) / 4)
    assert result.evicted_chunks == 0
    assert result.peak_cached_chunks == 8  # A AB ABC ABD ABCE X XB XBC
    # The partial tail is never stored, so an identical prompt hits only its complete chunks.
    assert simulate([_request(0, "A", 3), _request(1, "A", 3)], C).per_request_hit_tokens == [0, C]


def test_belady_beats_lru_which_beats_no_cache():
    requests = _workload("A", "B", "A", "C", "B", "A")
    # LRU(2): A B [A hit] C(evicts B) B(evicts A) A(evicts C): one hit.
    lru = simulate(requests, C, "lru", 2)
    assert lru.per_request_hit_tokens == [0, 0, C, 0, 0, 0] and lru.evicted_chunks == 3
    # MIN(2): at C, A (next use 5) goes rather than B (next use 4), so B hits too.
    belady = simulate(requests, C, "belady", 2)
    assert belady.per_request_hit_tokens == [0, 0, C, 0, C, 0] and belady.evicted_chunks == 2
    nothing = simulate(requests, C, "lru", 0)
    assert nothing.hit_tokens == 0 and nothing.peak_cached_chunks == 0
    assert simulate(requests, C, "belady", 0).hit_tokens == 0


def test_lru_thrashes_on_a_loop_that_belady_partly_keeps():
    requests = _workload("A", "B", "C", "A", "B", "C")
    assert simulate(requests, C, "lru", 2).hit_tokens == 0
    assert simulate(requests, C, "belady", 2).per_request_hit_tokens == [0, 0, 0, C, 0, C]


def test_lru_refreshes_hits_and_evicts_the_least_recently_used():
    # Capacity 3: after "AB" and "C", the hit on "A" refreshes A, so "D" evicts AB, not A.
    requests = _workload("AB", "C", "A", "D", "A", "AB")
    assert simulate(requests, C, "lru", 3).per_request_hit_tokens == [0, 0, C, 0, C, C]


def test_belady_evicts_the_deeper_chunk_when_next_uses_tie():
    # At "R", A and AB are both next used by request 2: dropping AB keeps a 1-chunk hit there;
    # dropping A would leave AB unreachable.
    result = simulate(_workload("AB", "R", "AB"), C, "belady", 2)
    assert result.per_request_hit_tokens == [0, 0, C]


def _brute_force_best_hits(sequence: list[str], capacity: int) -> int:
    """Most hits over every choice of victim (forced insertion), single-chunk requests."""
    best = 0

    def walk(position: int, cached: frozenset[str], hits: int) -> None:
        nonlocal best
        if position == len(sequence):
            best = max(best, hits)
            return
        key = sequence[position]
        if key in cached:
            walk(position + 1, cached, hits + 1)
        elif len(cached) < capacity:
            walk(position + 1, cached | {key}, hits)
        else:
            for victim in cached:
                walk(position + 1, (cached - {victim}) | {key}, hits)

    walk(0, frozenset(), 0)
    return best


def test_belady_is_optimal_for_independent_chunks():
    rng = np.random.default_rng(7)
    for _ in range(40):
        sequence = [str(letter) for letter in rng.choice(list("ABCDE"), size=10)]
        result = simulate(_workload(*sequence), C, "belady", 2)
        assert result.hit_tokens == C * _brute_force_best_hits(sequence, 2), sequence


@pytest.mark.parametrize(
    ("spec", "params"),
    [
        ("chat", {"system_prompt_tokens": 128, "question_tokens": [8, 64], "answer_tokens": [8, 64],
                  "concurrent_conversations": 6}),
        ("rag", {"num_documents": 30, "document_tokens": [32, 128], "system_prompt_tokens": 64}),
        ("docqa", {"document_tokens": [256, 512], "concurrent_documents": 3}),
    ],
)  # fmt: skip
def test_policies_are_ordered_and_never_exceed_capacity(spec, params):
    for seed in range(3):
        requests = list(make_workload(spec, num_requests=60, seed=seed, params=params))
        trace = hashed_trace(requests, 32)
        infinite = simulate_keys(trace)
        distinct = infinite.peak_cached_chunks
        assert infinite.hit_tokens > 0 and distinct == len(set(trace.query_keys.tolist()))
        for capacity in (distinct // 20, distinct // 5, distinct // 2):
            lru = simulate_keys(trace, "lru", capacity)
            belady = simulate_keys(trace, "belady", capacity)
            assert infinite.hit_tokens >= belady.hit_tokens >= lru.hit_tokens, (seed, capacity)
            for result in (lru, belady):
                assert result.peak_cached_chunks == capacity and result.evicted_chunks > 0
        for policy in ("lru", "belady"):
            roomy = simulate_keys(trace, policy, distinct)
            assert roomy.per_request_hit_tokens == infinite.per_request_hit_tokens
            assert roomy.evicted_chunks == 0


def test_random_workload_has_no_hits():
    requests = make_workload("random", num_requests=50, params={"prompt_tokens": [64, 512]})
    assert simulate(requests, 16).hit_tokens == 0


@pytest.mark.skipif(not MOONCAKE_TRACE.is_file(), reason=f"{MOONCAKE_TRACE} not present")
def test_mooncake_infinite_hits_equal_the_shared_hash_id_prefixes():
    with MOONCAKE_TRACE.open() as lines:
        records = [json.loads(line) for line in itertools.islice(lines, 300)]
    stored: set[tuple[int, ...]] = set()
    expected = []
    for record in records:
        ids, complete = (
            record["hash_ids"],
            record["input_length"] // 512,
        )  # partial last block: no chunk
        hit = 0
        while hit < complete and tuple(ids[: hit + 1]) in stored:
            hit += 1
        expected.append(hit * 512)
        stored.update(tuple(ids[:k]) for k in range(1, complete + 1))
    requests = make_workload(f"mooncake:{MOONCAKE_TRACE}", num_requests=300)
    result = simulate(requests, 512)
    assert result.per_request_hit_tokens == expected
    assert result.token_hit_rate == sum(expected) / sum(r["input_length"] for r in records)
    assert sum(h > 512 for h in expected) > 10  # hits beyond the shared first block happened


def test_bad_policy_arguments_are_rejected():
    requests = _workload("A")
    with pytest.raises(
        ValueError, match="unknown policy 'mru'; choose one of infinite, lru, fifo, lfu, belady"
    ):
        simulate(requests, C, "mru", 4)
    with pytest.raises(ValueError, match="'infinite' takes no capacity_chunks"):
        simulate(requests, C, "infinite", 4)
    with pytest.raises(ValueError, match="'lru' needs capacity_chunks >= 0, got None"):
        simulate(requests, C, "lru")
    with pytest.raises(ValueError, match="chunk_size must be positive"):
        simulate(requests, 0)
    assert simulate([], C).token_hit_rate == 0.0


def test_a_capacity_limited_oracle_run_tells_capacity_misses_from_cold_ones(tmp_path):
    from testbed.run import RunOptions, execute_run
    from testbed.spec.runspec import RunSpec

    base = dict(engine="oracle", workload="chat", requests=60, chunk_size=64)
    options = RunOptions(progress=False)
    unlimited = execute_run(RunSpec(**base), tmp_path, options)["tokens"]
    limited = execute_run(RunSpec(**base, capacity_tokens=1024), tmp_path, options)["tokens"]
    assert unlimited["capacity"] == 0 and limited["capacity"] > 0
    # The cold misses are the unlimited cache's misses; what it hit and the small one did not
    # is the capacity miss.
    assert limited["cold"] == unlimited["cold"]
    assert limited["external"] + limited["capacity"] == unlimited["external"]
