"""Workloads: determinism, prefix structure, popularity, caps, the Mooncake reader, errors."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from testbed.core.keys import chunk_hashes
from testbed.workloads import WORKLOADS, Workload, WorkloadRequest, make_workload

MOONCAKE_TRACE = (
    Path(__file__).resolve().parents[2].parent / "shared/data/mooncake/conversation_trace.jsonl"
)
needs_trace = pytest.mark.skipif(
    not MOONCAKE_TRACE.is_file(), reason=f"{MOONCAKE_TRACE} not present"
)

# Small generator settings so every generator runs in milliseconds.
SMALL: dict[str, dict[str, object]] = {
    "chat": {"system_prompt_tokens": 256, "question_tokens": [8, 32], "answer_tokens": [8, 64]},
    "docqa": {"document_tokens": [1024, 2048]},
    "rag": {"document_tokens": [64, 256]},
    "random": {"prompt_tokens": [64, 512]},
}


def _prompts(workload: Workload) -> list[np.ndarray]:
    return [request.prompt_token_ids for request in workload]


def _same_requests(a: list[WorkloadRequest], b: list[WorkloadRequest]) -> bool:
    return len(a) == len(b) and all(
        x.request_id == y.request_id
        and np.array_equal(x.prompt_token_ids, y.prompt_token_ids)
        and (x.max_output_tokens, x.arrival_s, x.group)
        == (y.max_output_tokens, y.arrival_s, y.group)
        for x, y in zip(a, b, strict=True)
    )


def _check_contract(requests: list[WorkloadRequest], vocab_size: int) -> None:
    assert len({r.request_id for r in requests}) == len(requests)
    arrivals = [r.arrival_s for r in requests]
    assert arrivals == sorted(arrivals) and arrivals[0] >= 0
    for request in requests:
        tokens = request.prompt_token_ids
        assert tokens.dtype == np.int32 and tokens.ndim == 1 and tokens.size >= 1
        assert tokens.min() >= 0 and tokens.max() < vocab_size
        assert request.max_output_tokens >= 1


# -------------------------------------------------------------------------------------------
# Generators
# -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_generators_are_deterministic_per_seed_and_keep_the_contract(name):
    workload = make_workload(name, num_requests=24, seed=3, vocab_size=1000, params=SMALL[name])
    first = list(workload)
    assert len(first) == 24 and workload.name == name
    _check_contract(first, vocab_size=1000)
    assert _same_requests(first, list(workload))  # iterating twice
    again = make_workload(name, num_requests=24, seed=3, vocab_size=1000, params=SMALL[name])
    assert _same_requests(first, list(again))
    other = list(make_workload(name, num_requests=24, seed=4, vocab_size=1000, params=SMALL[name]))
    pairs = zip(first, other, strict=True)
    assert not any(np.array_equal(a.prompt_token_ids, b.prompt_token_ids) for a, b in pairs)
    json.dumps(workload.describe())  # spec.json must be able to hold it


def test_chat_turns_extend_the_previous_prompt_and_its_answer():
    params = {**SMALL["chat"], "turns": 5, "concurrent_conversations": 3}
    requests = list(make_workload("chat", num_requests=40, params=params))
    by_conversation: dict[str, list[WorkloadRequest]] = {}
    for request in requests:
        by_conversation.setdefault(request.group, []).append(request)
    assert len(by_conversation) == 8
    system = requests[0].prompt_token_ids[:256]
    for turns in by_conversation.values():
        assert len(turns) == 5
        for request in turns:
            assert np.array_equal(request.prompt_token_ids[:256], system)
        for before, after in itertools.pairwise(turns):
            prefix = before.prompt_token_ids
            assert np.array_equal(after.prompt_token_ids[: len(prefix)], prefix)
            question_tokens = len(after.prompt_token_ids) - len(prefix) - before.max_output_tokens
            assert 8 <= question_tokens <= 32
    # Conversations interleave: not every conversation's turns are contiguous.
    groups = [r.group for r in requests]
    assert any(
        groups[i] != groups[i + 1] and groups[i] in groups[i + 2 :] for i in range(len(groups) - 2)
    )
    # Different conversations share the system prompt and nothing more (first question differs).
    firsts = [turns[0].prompt_token_ids for turns in by_conversation.values()]
    assert len({tuple(prompt[256:264]) for prompt in firsts}) == len(firsts)


def test_chat_output_cap_caps_the_answer_appended_to_the_next_turn():
    params = {**SMALL["chat"], "answer_tokens": [100, 200], "turns": 3}
    requests = list(make_workload("chat", num_requests=12, max_output_tokens=10, params=params))
    assert {r.max_output_tokens for r in requests} == {10}
    by_conversation: dict[str, list[WorkloadRequest]] = {}
    for request in requests:
        by_conversation.setdefault(request.group, []).append(request)
    for turns in by_conversation.values():
        for before, after in itertools.pairwise(turns):
            assert 8 + 10 <= len(after.prompt_token_ids) - len(before.prompt_token_ids) <= 32 + 10


def test_chat_conversation_count_follows_num_requests_or_fixes_it():
    assert make_workload("chat", num_requests=None).describe()["num_requests"] == 64
    fixed = make_workload(
        "chat", num_requests=None, params={**SMALL["chat"], "num_conversations": 3, "turns": 2}
    )
    assert len(list(fixed)) == 6
    with pytest.raises(
        ValueError, match=r"num_requests 7 exceeds num_conversations x turns = 3 x 2"
    ):
        make_workload("chat", num_requests=7, params={"num_conversations": 3, "turns": 2})


def test_docqa_questions_share_their_document_and_documents_share_nothing():
    requests = list(make_workload("docqa", num_requests=12, params=SMALL["docqa"]))
    by_document: dict[str, list[np.ndarray]] = {}
    for request in requests:
        by_document.setdefault(request.group, []).append(request.prompt_token_ids)
    assert sorted(len(prompts) for prompts in by_document.values()) == [4, 4, 4]
    for prompts in by_document.values():
        shared = min(len(p) for p in prompts) - 128  # questions are at most 128 tokens
        assert shared >= 1024 - 128
        assert all(np.array_equal(p[:shared], prompts[0][:shared]) for p in prompts)
    heads = {chunk_hashes(prompts[0], 64)[0] for prompts in by_document.values()}
    assert len(heads) == 3


def test_rag_documents_follow_zipf_popularity():
    # One fixed-length document right at the start of each prompt: its first tokens name it.
    def doc_counts(alpha: float) -> list[int]:
        params = {
            "num_documents": 20, "docs_per_request": 1, "zipf_alpha": alpha,
            "system_prompt_tokens": 0, "document_tokens": [64, 64], "question_tokens": [4, 8],
        }  # fmt: skip
        prompts = _prompts(make_workload("rag", num_requests=1000, params=params))
        return sorted(Counter(bytes(p[:16]) for p in prompts).values(), reverse=True)

    zipf = doc_counts(1.2)
    expected_top = 1000 / sum(r**-1.2 for r in range(1, 21))
    assert abs(zipf[0] - expected_top) < 0.2 * expected_top
    assert zipf[0] > 3 * zipf[9]
    uniform = doc_counts(0.0)
    assert len(uniform) == 20 and uniform[0] < 2 * uniform[-1]


def test_rag_places_the_more_popular_document_first():
    params = {
        "num_documents": 4, "docs_per_request": 2, "zipf_alpha": 1.5, "system_prompt_tokens": 32,
        "document_tokens": [64, 64], "question_tokens": [4, 8],
    }  # fmt: skip
    prompts = _prompts(make_workload("rag", num_requests=300, params=params))
    assert all(np.array_equal(p[:32], prompts[0][:32]) for p in prompts)
    pairs = [(bytes(p[32:48]), bytes(p[96:112])) for p in prompts]
    popularity = Counter(doc for pair in pairs for doc in pair)
    rank = {doc: index for index, (doc, _) in enumerate(popularity.most_common())}
    assert len(rank) == 4
    assert all(rank[first] < rank[second] for first, second in pairs)


def test_random_prompts_share_no_first_chunk():
    requests = list(make_workload("random", num_requests=300, params={"prompt_tokens": [64, 300]}))
    assert all(64 <= r.num_prompt_tokens <= 300 for r in requests)
    firsts = {chunk_hashes(r.prompt_token_ids, 64)[0] for r in requests}
    assert len(firsts) == 300


def test_arrivals_are_poisson_at_the_rate_or_all_at_zero():
    requests = list(
        make_workload(
            "random", num_requests=2000, params={"prompt_tokens": [1, 4], "arrival_rate_per_s": 4}
        )
    )
    gaps_s = np.diff([r.arrival_s for r in requests])
    assert requests[0].arrival_s == 0.0
    assert abs(gaps_s.mean() - 0.25) < 0.025
    assert abs(gaps_s.std() - 0.25) < 0.04  # exponential: std == mean
    batch = make_workload("random", num_requests=5, params={"arrival_rate_per_s": "inf"})
    assert {r.arrival_s for r in batch} == {0.0}


def test_output_lengths_stay_in_range_and_under_the_cap():
    uncapped = list(
        make_workload(
            "docqa", num_requests=20, params={**SMALL["docqa"], "output_tokens": [50, 60]}
        )
    )
    assert all(50 <= r.max_output_tokens <= 60 for r in uncapped)
    capped = list(
        make_workload(
            "docqa",
            num_requests=20,
            max_output_tokens=55,
            params={**SMALL["docqa"], "output_tokens": [50, 60]},
        )
    )
    assert max(r.max_output_tokens for r in capped) == 55
    for u, c in zip(uncapped, capped, strict=True):
        assert c.max_output_tokens == min(u.max_output_tokens, 55)


def test_params_accept_strings_and_lists_and_describe_reports_them():
    workload = make_workload(
        "rag",
        num_requests=3,
        params={"zipf_alpha": "0.8", "question_tokens": "4,9", "num_documents": 7.0},
    )
    params = workload.describe()["params"]
    assert isinstance(params, dict)
    assert (
        params["zipf_alpha"] == 0.8
        and params["question_tokens"] == (4, 9)
        and params["num_documents"] == 7
    )
    assert len(list(workload)) == 3


@pytest.mark.parametrize(
    ("spec", "params", "match"),
    [
        (
            "chats",
            None,
            r"unknown workload 'chats'; valid workloads: chat, docqa, rag, random, mooncake:PATH",
        ),
        (
            "chat",
            {"turn": 3},
            r"unknown chat param 'turn'; valid params: system_prompt_tokens, turns",
        ),
        ("chat", {"turns": 0}, r"turns must be >= 1, got 0"),
        ("chat", {"question_tokens": [9, 3]}, r"question_tokens must be a \[min, max\] pair"),
        ("chat", {"question_tokens": [1, 2, 3]}, r"chat param 'question_tokens': cannot use"),
        (
            "docqa",
            {"num_documents": "many"},
            r"docqa param 'num_documents': cannot use 'many' as int",
        ),
        (
            "rag",
            {"docs_per_request": 9, "num_documents": 4},
            r"docs_per_request \(9\) must not exceed",
        ),
        ("rag", {"zipf_alpha": -1}, r"zipf_alpha must be >= 0"),
        ("random", {"arrival_rate_per_s": 0}, r"arrival_rate_per_s must be > 0"),
        ("random", {"turns": 2}, r"unknown random param 'turns'; valid params: prompt_tokens"),
        ("csv:foo.csv", None, r"unknown trace format 'csv'.*mooncake:PATH"),
        ("mooncake:", None, r"names no trace file"),
    ],
)
def test_bad_specs_and_params_name_the_problem_and_the_choices(spec, params, match):
    with pytest.raises(ValueError, match=match):
        make_workload(spec, num_requests=4, params=params)


def test_bad_options_are_rejected():
    cases: list[tuple[dict[str, Any], str]] = [
        ({"num_requests": 0}, "num_requests must be >= 1"),
        ({"num_requests": 4, "vocab_size": 1}, "vocab_size must be >= 2"),
        ({"num_requests": 4, "max_output_tokens": 0}, "max_output_tokens must be >= 1"),
        ({"num_requests": 4, "seed": -1}, "seed must be >= 0"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            make_workload("random", **kwargs)


# -------------------------------------------------------------------------------------------
# Mooncake
# -------------------------------------------------------------------------------------------


def _records(n: int) -> list[dict]:
    with MOONCAKE_TRACE.open() as lines:
        return [json.loads(line) for line in itertools.islice(lines, n)]


def _common_prefix(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@needs_trace
def test_mooncake_replays_lengths_arrivals_and_order():
    records = _records(300)
    requests = list(make_workload(f"mooncake:{MOONCAKE_TRACE}", num_requests=300, vocab_size=5000))
    assert len(requests) == 300
    _check_contract(requests, vocab_size=5000)
    for record, request in zip(records, requests, strict=True):
        assert request.num_prompt_tokens == record["input_length"]
        assert request.max_output_tokens == max(1, record["output_length"])
        assert request.arrival_s == record["timestamp"] / 1000
    assert requests[7].request_id == "conversation_trace-000007"
    capped = make_workload(f"mooncake:{MOONCAKE_TRACE}", num_requests=300, max_output_tokens=64)
    assert [r.max_output_tokens for r in capped] == [
        min(64, max(1, r["output_length"])) for r in records
    ]


@needs_trace
@pytest.mark.parametrize("chunk_size", [64, 128, 256, 512])
def test_mooncake_requests_share_chunks_exactly_as_their_hash_ids(chunk_size):
    records = _records(200)
    requests = list(make_workload(f"mooncake:{MOONCAKE_TRACE}", num_requests=200))
    hashes = [chunk_hashes(r.prompt_token_ids, chunk_size) for r in requests]
    shared_pairs = longest_shared = 0
    for i, j in itertools.combinations(range(200), 2):
        common_ids = _common_prefix(records[i]["hash_ids"], records[j]["hash_ids"])
        common_tokens = min(
            common_ids * 512, records[i]["input_length"], records[j]["input_length"]
        )
        assert _common_prefix(hashes[i], hashes[j]) == common_tokens // chunk_size, (i, j)
        shared_pairs += common_ids > 1
        longest_shared = max(longest_shared, common_ids)
    # The check above saw real multi-block sharing (7 pairs, up to 38 blocks), not just block 0.
    assert shared_pairs >= 5 and longest_shared >= 30


@needs_trace
def test_mooncake_is_deterministic_per_seed_and_limits_to_the_first_n():
    spec = f"mooncake:{MOONCAKE_TRACE}"
    first = list(make_workload(spec, num_requests=30, seed=1))
    assert _same_requests(first, list(make_workload(spec, num_requests=30, seed=1)))
    assert _same_requests(first[:10], list(make_workload(spec, num_requests=10, seed=1)))
    other = list(make_workload(spec, num_requests=30, seed=2))
    assert not any(
        np.array_equal(a.prompt_token_ids[:512], b.prompt_token_ids[:512])
        for a, b in zip(first, other, strict=True)
    )
    description = make_workload(spec, num_requests=None).describe()
    assert description["num_requests"] is None and len(str(description["sha256"])) == 64


def _write(tmp_path: Path, lines: list[str]) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return f"mooncake:{path}"


_DROP = object()


def _line(**fields: object) -> str:
    """A valid trace record with ``fields`` replaced (``_DROP``: removed)."""
    record = {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1], **fields}
    return json.dumps({key: value for key, value in record.items() if value is not _DROP})


GOOD = _line()


@pytest.mark.parametrize(
    ("bad_line", "match"),
    [
        ("{not json", r"trace.jsonl:2: not a JSON object"),
        (_line(output_length=_DROP), r":2: missing output_length"),
        (_line(input_length=1100), r":2: 2 hash_ids for input_length 1100; expected .* = 3"),
        (_line(input_length=0, hash_ids=[]), r":2: input_length must be"),
        (_line(hash_ids=[0, -4]), r":2: hash_ids must be"),
        (_line(timestamp=-5), r":2: timestamp must be"),
        (_line(output_length="many"), r":2: output_length must be"),
    ],
)
def test_mooncake_malformed_lines_are_reported_with_their_line_number(tmp_path, bad_line, match):
    workload = make_workload(_write(tmp_path, [GOOD, bad_line, GOOD]), num_requests=None)
    requests = iter(workload)
    assert next(requests).num_prompt_tokens == 600  # streamed: the good line comes first
    with pytest.raises(ValueError, match=match):
        next(requests)


def test_mooncake_rejects_missing_files_params_and_time_going_backwards(tmp_path):
    with pytest.raises(ValueError, match="mooncake trace not found: .*nope.jsonl"):
        make_workload(f"mooncake:{tmp_path / 'nope.jsonl'}", num_requests=None)
    spec = _write(tmp_path, [_line(timestamp=2000), GOOD])
    with pytest.raises(ValueError, match="mooncake traces take no params"):
        make_workload(spec, num_requests=None, params={"rate": 2})
    with pytest.raises(
        ValueError, match=r":2: timestamp 0.0 is earlier than the previous record's 2000"
    ):
        list(make_workload(spec, num_requests=None))


def test_mooncake_partial_last_block_is_the_blocks_prefix(tmp_path):
    spec = _write(
        tmp_path,
        [
            json.dumps(
                {"timestamp": 0, "input_length": 700, "output_length": 0, "hash_ids": [3, 9]}
            ),
            json.dumps(
                {"timestamp": 1500, "input_length": 1100, "output_length": 2, "hash_ids": [3, 9, 4]}
            ),
            json.dumps(
                {"timestamp": 1500, "input_length": 512, "output_length": 2, "hash_ids": [3]}
            ),
        ],
    )
    short, long, single = make_workload(spec, num_requests=None)
    assert np.array_equal(long.prompt_token_ids[:700], short.prompt_token_ids)
    assert np.array_equal(single.prompt_token_ids, short.prompt_token_ids[:512])
    assert short.max_output_tokens == 1 and long.arrival_s == 1.5
