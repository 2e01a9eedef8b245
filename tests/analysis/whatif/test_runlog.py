"""A run's chunk event log as an access stream: the curve predicts what an LRU server hit."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pytest

from testbed.analysis.whatif import lru_curve, stack_distances
from testbed.analysis.whatif.curves import request_hit_tokens
from testbed.analysis.whatif.runlog import run_trace

C = 4  # tokens per chunk of the synthetic logs


def _hashes(labels: str) -> list[bytes]:
    """Prefix-chained chunk hashes, one label per chunk."""
    out, previous = [], b""
    for label in labels:
        previous = hashlib.blake2b(previous + label.encode(), digest_size=16).digest()
        out.append(previous)
    return out


@dataclass
class LoggedRun:
    chunks: pd.DataFrame
    requests: pd.DataFrame
    measured: list[int]
    """External hit tokens per request: ``max(0, min(H, P - 1) - E)`` of the LRU server."""


def lru_server_log(
    prompts: list[str], capacity_chunks: int, engine_hits: list[int], tp: int = 2,
    chunk_size: int = C, tail: int = 1,
) -> LoggedRun:  # fmt: skip
    """Plays an LRU cache server of ``capacity_chunks`` chunks (every TP rank's object moves
    together) over sequential requests and writes its chunk log as the server would: lookup
    rows (hits are touched), a commit per rank for each chunk it lacked (evicting the least
    recently used), a store touch for present chunks past the hit, end-session touches."""
    rows: list[dict] = []
    cache: OrderedDict[bytes, None] = OrderedDict()

    def row(event: str, chunk: bytes, **values: object) -> None:
        rows.append({"seq": len(rows), "time_ns": 1_000 * len(rows), "event": event,
                     "chunk_hash": chunk, "kv_rank": -1, "namespace": "tiny|2|",
                     "session_id": "", "position": -1, "status": "", "cause": "",
                     "span_id": "", "nbytes": 0, **values})  # fmt: skip

    measured, requests = [], []
    for index, (labels, engine) in enumerate(zip(prompts, engine_hits, strict=True)):
        session = f"run:r{index}"
        hashes = _hashes(labels)
        status = ["hit" if h in cache else "absent" for h in hashes]
        for position, (chunk, state) in enumerate(zip(hashes, status, strict=True)):
            row("lookup", chunk, session_id=session, position=position, status=state,
                span_id=f"lookup-{index}")  # fmt: skip
        for chunk, state in zip(hashes, status, strict=True):
            if state == "hit":
                cache.move_to_end(chunk)
        leading = next((i for i, s in enumerate(status) if s != "hit"), len(status))
        prompt_tokens = len(labels) * chunk_size + tail
        measured.append(max(0, min(leading * chunk_size, prompt_tokens - 1) - engine))
        for position, chunk in enumerate(hashes):
            if chunk in cache:
                if position >= leading:
                    cache.move_to_end(chunk)
                    for rank in range(tp):
                        row("touch", chunk, kv_rank=rank, cause="store", session_id=session)
                continue
            while capacity_chunks and len(cache) >= capacity_chunks:
                victim, _ = cache.popitem(last=False)
                for rank in range(tp):
                    row("evict", victim, kv_rank=rank, cause="capacity")
            if capacity_chunks:
                for rank in range(tp):
                    row("reserve", chunk, kv_rank=rank, session_id=session, position=position)
                    row("commit", chunk, kv_rank=rank, session_id=session, position=position,
                        nbytes=512)  # fmt: skip
                cache[chunk] = None
        for chunk in hashes:
            if chunk in cache:
                cache.move_to_end(chunk)
                for rank in range(tp):
                    row("touch", chunk, kv_rank=rank, cause="end_session", session_id=session)
        requests.append({"session_id": session, "group": "g" if index % 2 else "",
                         "prompt_tokens": prompt_tokens, "engine_hit_tokens": engine})  # fmt: skip
    chunks = pd.DataFrame(rows)
    for column in ("event", "namespace", "session_id", "status", "cause", "span_id"):
        chunks[column] = chunks[column].astype("category")
    return LoggedRun(chunks, pd.DataFrame(requests), measured)


def _workload(seed: int, num_requests: int = 120) -> tuple[list[str], list[int]]:
    """Prompts sharing prefixes (a few "documents", growing "conversations") and engine hits."""
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(num_requests):
        base = "SYS" if rng.random() < 0.7 else ""
        doc = "abcdefgh"[: int(rng.integers(0, 8))] + str(int(rng.integers(0, 6)))
        prompts.append(base + doc + "xyz"[: int(rng.integers(0, 3))])
    engine = [int(rng.choice([0, 0, C, 2 * C + 1])) for _ in prompts]
    return prompts, engine


@pytest.mark.parametrize("capacity", [6, 12, 30])
def test_the_curve_at_the_runs_capacity_predicts_every_requests_external_hits(capacity):
    prompts, engine = _workload(seed=capacity)
    run = lru_server_log(prompts, capacity, engine)
    trace = run_trace(run.chunks, run.requests, C)
    stack = stack_distances(trace)
    predicted = request_hit_tokens(trace, stack, capacity * C)
    assert predicted.tolist() == run.measured
    assert sum(run.measured) > 0
    curve = lru_curve(trace, stack)
    point = curve.at(capacity * C)
    assert point.external_hit_tokens == sum(run.measured)
    assert point.hit_tokens == sum(run.measured) + sum(engine)


def test_one_runs_log_predicts_runs_at_other_capacities():
    # Every request ends by touching all its chunks, so the stream's recency order does not
    # depend on the capacity it was recorded at (when a request fits in the cache).
    prompts, engine = _workload(seed=3)
    recorded = run_trace(*_inputs(lru_server_log(prompts, 14, engine)), C)
    stack = stack_distances(recorded)
    for capacity in (12, 20, 40):
        other = lru_server_log(prompts, capacity, engine)
        assert request_hit_tokens(recorded, stack, capacity * C).tolist() == other.measured


def test_a_chunk_log_rechunks_to_multiples_of_its_chunk_size():
    prompts, _ = _workload(seed=5)
    coarse_prompts = [p[: len(p) // 2 * 2] for p in prompts]  # whole coarse chunks
    # The same prompts in chunks of C (capacity 20) and of 2C (capacity 9).
    zero = [0] * len(prompts)
    fine = run_trace(*_inputs(lru_server_log(coarse_prompts, 20, zero, tail=3)), C)
    coarse_log = lru_server_log([_pairs(p) for p in coarse_prompts], 9, zero, chunk_size=2 * C,
                                tail=3)  # fmt: skip
    coarse = run_trace(*_inputs(coarse_log), 2 * C)
    derived = fine.at_chunk_size(2 * C)
    a = lru_curve(derived, stack_distances(derived))
    b = lru_curve(coarse, stack_distances(coarse))
    assert a.num_distinct_keys == b.num_distinct_keys
    assert np.array_equal(a.hit_tokens, b.hit_tokens)
    assert a.at(None).hit_tokens > 0


def test_touch_rows_take_their_chunks_position_and_later_lookups_answer_for_nobody():
    run = lru_server_log(["AB", "AB"], 10, [0, 0], tp=1)
    again = run.chunks[run.chunks["event"] == "lookup"].assign(
        seq=lambda f: f["seq"] + 10_000, time_ns=lambda f: f["time_ns"] + 10**9,
        span_id="lookup-again",
    )  # fmt: skip
    chunks = pd.concat([run.chunks, again], ignore_index=True)
    trace = run_trace(chunks, run.requests, C)
    touched = trace.ref_positions[trace.ref_positions >= 0]
    assert len(touched) == len(trace.ref_positions)  # every touch got a position
    assert (trace.step_request >= 0).sum() == 2
    assert request_hit_tokens(trace, stack_distances(trace), None).tolist() == [0, 2 * C]


def _inputs(run: LoggedRun) -> tuple[pd.DataFrame, pd.DataFrame]:
    return run.chunks, run.requests


def _pairs(labels: str) -> str:
    """Two fine chunks as one coarse label (one-to-one: coarse prefixes match fine ones)."""
    return "".join(chr(0x100 + ord(a) * 131 + ord(b)) for a, b in
                   zip(labels[::2], labels[1::2], strict=True))  # fmt: skip


def test_a_prefetchs_commits_in_l1_are_not_references_the_lookups_hit_rows_are():
    # A disk tier's prefetch commits the chunk in L1 (cause tier_promote) when its read
    # completes, before the lookup that asked settles: the log has those commits just before
    # the lookup's rows. Counted as references they would make every hit an L1 hit.
    prompts, engine = _workload(seed=6)
    run = lru_server_log(prompts, 6, engine, tp=1)
    lookups = run.chunks[run.chunks["event"] == "lookup"]
    first = lookups.groupby("span_id")["time_ns"].transform("min")
    hits = lookups[lookups["status"] == "hit"]
    promoted = hits.assign(
        event="commit", status="disk", cause="tier_promote", position=-1,
        time_ns=first[hits.index] - 1, seq=hits["seq"] + 100_000,
    )  # fmt: skip
    chunks = pd.concat([run.chunks, promoted], ignore_index=True)
    assert len(promoted) > 0
    trace = run_trace(chunks, run.requests, C)
    assert request_hit_tokens(trace, stack_distances(trace), 6 * C).tolist() == run.measured
    plain = run_trace(run.chunks, run.requests, C)
    assert np.array_equal(trace.ref_keys, plain.ref_keys)
