"""The scheduler-side decisions on their own (no server, no vLLM)."""

from __future__ import annotations

import pytest

from connector.planner import (
    Geometry,
    lock_release_after_alloc,
    plan_retrieve,
    plan_store,
    tokens_to_load,
)
from connector.tracker import Phase, RequestTracker
from testbed.core.keys import chunk_hashes

G = Geometry(chunk_size=64, block_size=16)


def tracker(num_tokens: int, hit_tokens: int | None = None, engine_hit: int = 0) -> RequestTracker:
    tokens = list(range(num_tokens))
    t = RequestTracker(
        request_id="r",
        session_id="e:r",
        token_ids=tokens,
        num_prompt_tokens=num_tokens,
        cache_salt="",
        traceparent="",
        chunk_hashes=chunk_hashes(tokens, G.chunk_size),
    )
    t.hit_tokens = hit_tokens
    t.locks_held = bool(hit_tokens)
    t.engine_hit_tokens = engine_hit
    return t


def test_the_hit_is_the_max_of_engine_and_external_never_the_sum():
    assert tokens_to_load(hit_tokens=192, num_computed_tokens=0, num_tokens=300) == 192
    assert tokens_to_load(hit_tokens=192, num_computed_tokens=80, num_tokens=300) == 112
    assert tokens_to_load(hit_tokens=128, num_computed_tokens=160, num_tokens=300) == 0
    # The engine computes the last token even on a full hit.
    assert tokens_to_load(hit_tokens=256, num_computed_tokens=0, num_tokens=256) == 255


def test_retrieve_starts_at_the_chunk_holding_the_engine_boundary():
    t = tracker(300, hit_tokens=256, engine_hit=80)
    t.block_ids = list(range(100, 119))
    assert lock_release_after_alloc(t, 176, G) == (0, 80)
    op = plan_retrieve(t, G)
    assert (op.start_token, op.end_token, op.skip_first_n_tokens) == (64, 256, 16)
    assert op.block_ids == list(range(104, 116))
    assert op.chunk_hashes == t.chunk_hashes[1:4] and op.first_chunk == 1
    assert t.phase is Phase.READY and plan_retrieve(t, G) is None


def test_no_load_frees_every_lock_and_plans_no_retrieve():
    t = tracker(300, hit_tokens=128, engine_hit=160)
    assert lock_release_after_alloc(t, 0, G) == (0, 128)
    assert t.phase is Phase.READY and plan_retrieve(t, G) is None
    assert t.num_stored_chunks == 2


@pytest.mark.parametrize("budget", [16, 48, 64, 100, 200])
def test_chunked_prefill_stores_every_full_prompt_chunk_once(budget):
    t = tracker(300, hit_tokens=0)
    lock_release_after_alloc(t, 0, G)
    stored: list[tuple[int, int]] = []
    computed = 0
    while computed < 300:
        step = min(budget, 300 - computed)
        t.block_ids = list(range(-(-(computed + step) // 16)))
        op = plan_store(t, G, computed + step)
        if op is not None:
            assert len(op.block_ids) == len(op.chunk_hashes) * 4
            stored.append((op.start_token, op.end_token))
        computed += step
    for _ in range(5):  # decode steps store nothing
        t.token_ids.append(7)
        assert plan_store(t, G, computed + 1) is None
        computed += 1
    covered = [tok for start, end in stored for tok in range(start, end)]
    assert covered == list(range(256))


def test_decode_chunks_are_stored_only_when_configured():
    t = tracker(100, hit_tokens=0)
    lock_release_after_alloc(t, 0, G)
    t.block_ids = list(range(16))
    assert plan_store(t, G, 100).end_token == 64
    t.token_ids.extend(range(1000, 1060))
    assert plan_store(t, G, 160) is None
    op = plan_store(t, G, 160, store_decode_tokens=True)
    assert (op.start_token, op.end_token) == (64, 128)
    assert op.chunk_hashes == chunk_hashes(t.token_ids, 64)[1:2]


def test_geometry_rejects_chunks_that_are_not_whole_blocks():
    with pytest.raises(ValueError, match="multiple of the engine's block size"):
        Geometry(chunk_size=100, block_size=32)
