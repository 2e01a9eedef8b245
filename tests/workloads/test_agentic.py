"""The agentic reader: kv-cache-tester conversations as requests, tokens synthesised from block
ids that share exactly what the ids share, arrivals as recorded or from closed-loop users."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from testbed.core.keys import chunk_hashes
from testbed.models.access_trace import hashed_trace
from testbed.spec.runspec import RunSpec
from testbed.workloads import AgenticWorkload, make_workload
from testbed.workloads.block_keys import block_key_trace

TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "kv-cache-tester"
needs_traces = pytest.mark.skipif(not TRACES.is_dir(), reason="no kv-cache-tester traces")
B = 64


def call(t, ids, *, tail=10, think=None, api=None, out=5, kind="n"):
    entry = {"t": t, "type": kind, "in": len(ids) * B + tail, "out": out, "hash_ids": ids}
    if think is not None:
        entry["think_time"] = think
    if api is not None:
        entry["api_time"] = api
    return entry


def agent(t, agent_id, requests):
    return {"t": t, "type": "subagent", "agent_id": agent_id, "requests": requests}


def write(directory: Path, name: str, requests, **top) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    document = {"id": name, "block_size": B, "hash_id_scope": "local", "requests": requests}
    path = directory / f"{name}.json"
    path.write_text(json.dumps({**document, **top}))
    return path


def load(path, **params):
    return list(make_workload(f"agentic:{path}", num_requests=None, params=params))


SESSION = [
    call(0.0, [1, 2], think=0.0, api=2.0),
    agent(10.0, "agent_001", [call(0.0, [7, 8], think=0.0, api=1.0),
                              call(4.0, [7, 8, 9], think=1.0)]),
    call(12.0, [1, 2, 3], think=6.0, api=1.0),
    call(20.0, [1, 2, 3, 4], kind="s"),  # no think_time: the recorded gap (20 - 13 = 7)
]  # fmt: skip


def test_requests_carry_their_conversation_or_sub_agent_and_arrive_as_recorded(tmp_path):
    requests = load(write(tmp_path, "conv", SESSION))
    order = [(r.request_id, r.group, r.arrival_s) for r in requests]
    assert order == [
        ("conv-0000", "conv", 0.0),
        ("conv/agent_001-0000", "conv/agent_001", 10.0),  # the parent's t plus its own
        ("conv-0001", "conv", 12.0),
        ("conv/agent_001-0001", "conv/agent_001", 14.0),
        ("conv-0002", "conv", 20.0),
    ]
    assert [r.num_prompt_tokens for r in requests] == [138, 138, 202, 202, 266]


def test_users_send_each_request_its_think_time_after_the_previous_finished(tmp_path):
    # Served instantly (the order the oracle sees): each request finishes as it arrives.
    requests = load(write(tmp_path, "conv", SESSION), users=1)
    arrivals = {r.request_id: r.arrival_s for r in requests}
    assert arrivals["conv-0000"] == 0.0
    assert arrivals["conv-0001"] == 6.0  # think_time after conv-0000
    assert arrivals["conv-0002"] == 6.0 + 7.0  # no think_time: the recorded gap
    # The sub-agent starts the recorded gap after the parent request before it was answered
    # (10 - (0 + 2) = 8 s), then thinks as recorded.
    assert arrivals["conv/agent_001-0000"] == 8.0
    assert arrivals["conv/agent_001-0001"] == 9.0
    capped = load(tmp_path / "conv.json", users=1, max_think_s=5.0)
    assert {r.request_id: r.arrival_s for r in capped}["conv-0002"] == 10.0


def test_equal_ids_give_equal_tokens_in_a_conversation_and_never_across_files(tmp_path):
    first = load(write(tmp_path / "one", "conv", SESSION))
    again = load(write(tmp_path / "two", "other", SESSION))  # the same ids, another conversation
    by_id = {r.request_id: r.prompt_token_ids for r in first}
    assert np.array_equal(by_id["conv-0000"][: 2 * B], by_id["conv-0002"][: 2 * B])
    assert np.array_equal(by_id["conv/agent_001-0000"][:B], by_id["conv/agent_001-0001"][:B])
    assert not np.array_equal(by_id["conv-0000"][:B], by_id["conv/agent_001-0000"][:B])
    assert not np.array_equal(first[0].prompt_token_ids[:B], again[0].prompt_token_ids[:B])
    # The tail after the last complete block is each request's own, even for equal ids.
    twins = load(write(tmp_path / "three", "twins", [call(0, [1, 2]), call(1, [1, 2])]))
    a, b = (r.prompt_token_ids for r in twins)
    assert np.array_equal(a[: 2 * B], b[: 2 * B]) and not np.array_equal(a[2 * B :], b[2 * B :])
    assert _same(first, load(tmp_path / "one"))  # deterministic


def _same(a, b) -> bool:
    return [r.request_id for r in a] == [r.request_id for r in b] and all(
        np.array_equal(x.prompt_token_ids, y.prompt_token_ids) for x, y in zip(a, b, strict=True)
    )


def _common(a, b) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


@pytest.fixture(scope="module")
def shipped(tmp_path_factory) -> Path:
    """Three shipped conversations (one with sub-agents), capped to keep the tokens few."""
    directory = tmp_path_factory.mktemp("shipped")
    for name in ("trace_0010", "trace_0274", "trace_0398"):
        (directory / f"{name}.json").symlink_to(TRACES / f"{name}.json")
    return directory


@needs_traces
def test_chunks_share_exactly_the_leading_block_ids_of_the_shipped_traces(shipped):
    params = {"max_input_tokens": 40_000}
    workload = make_workload(f"agentic:{shipped}", num_requests=None, params=params)
    assert isinstance(workload, AgenticWorkload)
    blocks = list(workload.block_requests())
    requests = list(workload)
    assert len({r.group for r in requests}) >= 4  # sub-agents of trace_0010 and trace_0274
    shared = 0
    for chunk_size in (32, 64, 256):
        hashes = [chunk_hashes(r.prompt_token_ids, chunk_size) for r in requests]
        for i, j in itertools.combinations(range(len(requests)), 2):
            same_scope = blocks[i].scope == blocks[j].scope
            ids = _common(blocks[i].block_ids, blocks[j].block_ids) if same_scope else 0
            expected = ids * B // chunk_size
            assert _common(hashes[i], hashes[j]) == expected, (chunk_size, i, j)
            shared += expected > 0 and blocks[i].group != blocks[j].group
    assert shared > 10  # sub-agents share with each other: the check saw cross-group sharing


@needs_traces
@pytest.mark.parametrize("chunk_size", [32, 64, 96, 256])
def test_keys_from_block_ids_equal_the_hashed_tokens_keys(shipped, chunk_size):
    workload = make_workload(
        f"agentic:{shipped}", num_requests=None, params={"max_input_tokens": 30_000}
    )
    assert isinstance(workload, AgenticWorkload)
    fast = block_key_trace(list(workload.block_requests()), chunk_size)
    hashed = hashed_trace(list(workload), chunk_size)
    # The same partition of the chunks (equal keys exactly where the hashes are equal).
    assert fast.query_offsets.tolist() == hashed.query_offsets.tolist()
    pairs = set(zip(fast.query_keys.tolist(), hashed.query_keys.tolist(), strict=True))
    distinct = set(hashed.query_keys.tolist())
    assert len(pairs) == len(distinct) == len(set(fast.query_keys.tolist()))
    assert fast.prompt_tokens.tolist() == hashed.prompt_tokens.tolist()


def test_max_input_tokens_ends_an_agent_before_its_first_longer_request(tmp_path):
    requests = [
        call(0, [1]),
        agent(1, "early", [call(0, [5]), call(1, [5, 6, 7])]),
        call(2, [1, 2]),
        call(3, [1, 2, 3, 4]),  # over the cap: the session ends here
        agent(4, "late", [call(0, [8])]),
        call(5, [1]),
    ]
    kept = load(write(tmp_path, "conv", requests), max_input_tokens=3 * B)
    assert [r.request_id for r in kept] == ["conv-0000", "conv/early-0000", "conv-0001"]
    with pytest.raises(ValueError, match="no request left"):
        load(tmp_path / "conv.json", max_input_tokens=B)


def test_max_sessions_keeps_a_seeded_sample(tmp_path):
    for index in range(6):
        write(tmp_path, f"c{index}", [call(0, [index])])

    def groups(seed):
        spec = make_workload(
            f"agentic:{tmp_path}", num_requests=None, seed=seed, params={"max_sessions": 3}
        )
        return sorted({r.group for r in spec})

    assert len(groups(0)) == 3 and groups(0) == groups(0)
    assert any(groups(seed) != groups(0) for seed in range(1, 6))
    assert len(load(tmp_path)) == 6


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        (call(0, [1, 2], tail=B), r"requests\[1\]: 2 hash_ids for in=192; expected .* = 3"),
        ({**call(0, [1]), "in": 0}, r"requests\[1\]: in must be an integer >= 1"),
        ({**call(0, [1]), "t": -1}, r"requests\[1\]: t must be a number of seconds >= 0"),
        ({**call(0, [1]), "think_time": "x"}, r"requests\[1\]: think_time must be a number"),
        ({**call(0, [1]), "hash_ids": [1, -2]}, r"requests\[1\]: hash_ids must be a list"),
        ({**call(0, [1]), "type": "q"}, r"requests\[1\]: type must be one of"),
        (agent(0, "a/b", []), r"requests\[1\]: agent_id must be a name without '/'"),
        (agent(0, "a", [call(0, [1]), {"type": "n"}]), r"requests\[1\]\.requests\[1\]: in must"),
    ],
)
def test_malformed_entries_are_named_with_their_file_and_place(tmp_path, entry, match):
    path = write(tmp_path, "bad", [call(0, [1]), entry])
    with pytest.raises(ValueError, match=match):
        load(path)


def test_bad_files_paths_and_params_are_refused(tmp_path):
    with pytest.raises(ValueError, match="agentic trace not found"):
        load(tmp_path / "missing")
    with pytest.raises(ValueError, match="no .json conversation files"):
        load(tmp_path)
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="broken.json: not a JSON conversation"):
        load(tmp_path)
    write(tmp_path / "scope", "conv", [call(0, [1])], hash_id_scope="galactic")
    with pytest.raises(ValueError, match="hash_id_scope must be one of"):
        load(tmp_path / "scope")
    with pytest.raises(ValueError, match="unknown agentic param 'user'"):
        load(tmp_path / "scope", user=2)
    with pytest.raises(ValueError, match="users must be >= 1"):
        load(tmp_path / "scope", users=0)


def test_closed_loop_users_need_an_engine_that_releases_requests_on_completion():
    users = {"workload": "agentic:some/dir", "workload_params": {"users": 4}}
    for engine in ("vllm", "serve"):
        with pytest.raises(ValueError, match=f"the replay, fleet or oracle engine: the {engine}"):
            RunSpec(engine=engine, **users)
    with pytest.raises(ValueError, match="arrival 'all' sends every request at once"):
        RunSpec(arrival="all", **users)
    RunSpec(engine="oracle", **users)
    RunSpec(engine="fleet", instances=2, **users)
    RunSpec(engine="vllm", workload="agentic:some/dir")  # the trace's own times: any engine


def test_the_description_names_the_files_content_and_the_mode(tmp_path):
    path = write(tmp_path, "conv", SESSION)
    before = make_workload(f"agentic:{tmp_path}", num_requests=None, params={"users": 2})
    described = before.describe()
    assert described["arrival_mode"] == "users" and described["users"] == 2
    shutil.copy(path, tmp_path / "more.json")
    assert (
        make_workload(f"agentic:{tmp_path}", num_requests=None).describe()["sha256"]
        != (described["sha256"])
    )


@pytest.mark.parametrize("scope", ["local", "global"])
def test_copies_repeat_every_session_under_new_ids_with_blocks_of_their_own(tmp_path, scope):
    write(tmp_path, "conv", SESSION, hash_id_scope=scope)
    once = load(tmp_path)
    thrice = load(tmp_path, copies=3)
    assert len(thrice) == 3 * len(once)
    assert _same(once, [r for r in thrice if "#" not in r.request_id])  # copy 0: the original
    copy = sorted((r for r in thrice if r.group.startswith("conv#2")), key=lambda r: r.arrival_s)
    assert [(r.request_id, r.group) for r in copy] == [
        (r.request_id.replace("conv", "conv#2", 1), r.group.replace("conv", "conv#2", 1))
        for r in once
    ]
    assert [r.arrival_s for r in copy] == [r.arrival_s for r in once]
    assert [r.num_prompt_tokens for r in copy] == [r.num_prompt_tokens for r in once]
    by_id = {r.request_id: r.prompt_token_ids for r in copy}
    assert np.array_equal(by_id["conv#2-0000"][: 2 * B], by_id["conv#2-0002"][: 2 * B])
    for original, repeated in zip(once, copy, strict=True):  # no block shared with the original
        assert not np.array_equal(original.prompt_token_ids[:B], repeated.prompt_token_ids[:B])
