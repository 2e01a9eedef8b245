"""The id prefixes of block requests are numbered, by sorting a length at a time, exactly as
the dict walk they replaced numbered them (first appearance in walking order)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from testbed.workloads import make_workload
from testbed.workloads.block_keys import BlockKeys, prefix_numbers

TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "kv-cache-tester"


def _walked(blocks: list[list[int]], scopes: list[int | None]) -> list[int]:
    """The dict walk ``BlockKeys`` used to number the prefixes with."""
    prefixes: dict[tuple[int, int], int] = {}
    roots: dict[int | None, int] = {}
    ids = []
    for request, scope in zip(blocks, scopes, strict=True):
        parent = roots.setdefault(scope, -1 - len(roots))
        for block_id in request:
            parent = prefixes.setdefault((parent, block_id), len(prefixes))
            ids.append(parent)
    return ids


def _numbered(blocks: list[list[int]], scopes: list[int | None]) -> list[int]:
    roots: dict[int | None, int] = {}
    codes = np.array([roots.setdefault(s, -1 - len(roots)) for s in scopes], dtype=np.int64)
    flat = np.array([b for request in blocks for b in request], dtype=np.int64)
    counts = np.array([len(request) for request in blocks], dtype=np.int64)
    return prefix_numbers(flat, counts, codes).tolist()


@pytest.mark.parametrize("seed", range(4))
def test_random_chains_are_numbered_as_the_walk_numbered_them(seed):
    rng = np.random.default_rng(seed)
    stems = [rng.integers(0, 50, size=30).tolist() for _ in range(5)]
    blocks, scopes = [], []
    for _ in range(200):
        stem = stems[int(rng.integers(0, len(stems)))]
        cut = int(rng.integers(0, len(stem) + 1))
        blocks.append(stem[:cut] + rng.integers(0, 50, size=int(rng.integers(0, 4))).tolist())
        scopes.append([None, 7, 9][int(rng.integers(0, 3))])  # equal ids, other scopes
    assert _numbered(blocks, scopes) == _walked(blocks, scopes)
    assert _numbered([], []) == [] and _numbered([[]], [None]) == []


@pytest.mark.skipif(not TRACES.is_dir(), reason="no kv-cache-tester traces")
def test_the_shipped_corpus_and_its_copies_are_numbered_as_the_walk_numbered_them():
    workload = make_workload(
        f"agentic:{TRACES}",
        num_requests=None,
        params={"copies": 2, "max_sessions": 5, "max_input_tokens": 60_000},
    )
    requests = list(workload.block_requests())  # type: ignore[attr-defined]  # fmt: skip
    walked = _walked([r.block_ids.tolist() for r in requests], [r.scope for r in requests])
    assert BlockKeys(requests).prefix_ids.tolist() == walked
