"""The core contract, end to end: connector sides ↔ real server process over real ZeroMQ."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from connector.kv_copy import PagedKV
from tests.support.cache_harness import BLOCK_SIZE, Harness, blocks_equal
from tests.support.quiescence import assert_quiescent

C = 64  # chunk size of the `server` fixture


def prompt(n: int, offset: int = 0) -> list[int]:
    """``n`` tokens; prompts with the same ``offset`` share prefixes, others share nothing."""
    return [(35_761 * i + 40_503 * offset) % 50_000 for i in range(n)]


def blocks(first: int, count: int) -> list[int]:
    return list(range(first, first + count))


@pytest.fixture(params=["worker", "server"])
def mode(request) -> str:
    """Who copies the bytes: the worker (into the mapped pool) or the server (from the
    worker's KV in shared memory). Every copying test runs in both."""
    return request.param


def test_store_then_lookup_hits_every_complete_chunk_and_retrieve_is_bit_exact(
    server, mode, monkeypatch
):
    tokens = prompt(200)  # 3 complete chunks + 8 tokens
    if mode == "server":  # the worker must not copy a byte itself

        def refuse(*args, **kwargs):
            raise AssertionError("a server-driven worker copied blocks itself")

        monkeypatch.setattr(PagedKV, "store_chunks", refuse)
        monkeypatch.setattr(PagedKV, "load_chunks", refuse)
    with Harness(server, transfer_mode=mode) as h:
        h.prefill("a", tokens, blocks(0, 13))
        assert h.stats().num_objects == 3
        assert h.matched("b", tokens) == 3 * C
        plan = h.allocate("b", blocks(40, 13), 3 * C)
        (retrieve,) = plan.retrieves
        assert (retrieve.start_token, retrieve.end_token) == (0, 3 * C)
        (outcome,) = h.load(plan)
        assert outcome.finished == {"b"} and outcome.failed_block_ids == set()
        assert blocks_equal(h.ranks[0].kv, blocks(0, 12), blocks(40, 12))
        assert not blocks_equal(h.ranks[0].kv, blocks(0, 12), blocks(60, 12))
        assert_quiescent(h.stats())


def test_short_prompts_never_store_or_hit_and_hits_are_chunk_multiples(server):
    with Harness(server) as h:
        h.prefill("short", prompt(C - 1), blocks(0, 4))
        assert h.stats().num_objects == 0
        assert h.matched("short-again", prompt(C - 1)) == 0
        h.prefill("long", prompt(5 * C + 3), blocks(0, 21))
        for n in (C - 1, C, C + 1, 2 * C + 17, 3 * C, 5 * C + 3, 7 * C):
            loaded = h.matched(f"probe-{n}", prompt(n))
            hit = h.side.trackers[f"probe-{n}"].hit_tokens
            assert hit == min(n // C, 5) * C and hit % C == 0, n
            assert loaded == min(hit, n - 1), n  # the engine always computes the last token
            h.side.request_finished(f"probe-{n}")


def test_a_changed_token_caps_the_hit_and_other_namespaces_miss(server, start_server):
    tokens = prompt(4 * C + 5)
    with Harness(server) as h:
        h.prefill("a", tokens, blocks(0, 17))
        for k in range(4):
            changed = list(tokens)
            changed[k * C + 3] += 1
            assert h.matched(f"changed-{k}", changed) == k * C
        assert h.matched("same", tokens) == 4 * C
        assert h.matched("salted", tokens, salt="tenant-b") == 0
    with Harness(server, model="other-model") as other:
        assert other.matched("other-model", tokens) == 0
    with Harness(server, tp=2) as tp2:
        assert tp2.matched("tp2", tokens) == 0


def test_retrieve_leaves_skipped_engine_blocks_untouched(server, mode):
    tokens = prompt(3 * C + 10)
    with Harness(server, transfer_mode=mode) as h:
        h.prefill("a", tokens, blocks(0, 13))
        engine_hit = C + BLOCK_SIZE  # the engine holds chunk 0 and one block of chunk 1
        assert h.matched("b", tokens, engine_hit=engine_hit) == 3 * C - engine_hit
        target = blocks(50, 13)
        kv = h.ranks[0].kv
        sentinel = [layer[target].clone() for layer in kv.layers]
        plan = h.allocate("b", target, 3 * C - engine_hit)
        (retrieve,) = plan.retrieves
        assert retrieve.start_token == C and retrieve.skip_first_n_tokens == BLOCK_SIZE
        h.load(plan)
        skipped = target[C // BLOCK_SIZE]  # first block of chunk 1
        for layer, before in zip(kv.layers, sentinel, strict=True):
            assert torch.equal(layer[skipped], before[C // BLOCK_SIZE])
            assert torch.equal(layer[target[: C // BLOCK_SIZE]], before[: C // BLOCK_SIZE])
        loaded = target[C // BLOCK_SIZE + 1 : 12]
        assert blocks_equal(kv, blocks(C // BLOCK_SIZE + 1, len(loaded)), loaded)
        assert h.stats().num_locks == 0  # chunk 0's lock freed at alloc, the rest by retrieve


def test_free_releases_only_complete_chunks_below_the_end(server):
    tokens = prompt(3 * C + 1)
    with Harness(server) as h:
        h.prefill("a", tokens, blocks(0, 13))
        h.matched("b", tokens)
        session = h.side.session_id("b")
        assert h.stats().num_locks == 3
        h.client.free_locks(session, 0, C + C // 2)
        assert h.stats().num_locks == 2
        h.client.free_locks(session, 0, 2 * C)
        assert h.stats().num_locks == 1
        h.client.free_locks(session, 0, 3 * C)
        assert h.stats().num_locks == 0


def test_end_session_keeps_locks_and_the_read_lock_ttl_releases_them(start_server):
    server = start_server("--chunk-size", str(C), "--capacity", "16MiB", "--read-lock-ttl", "0.5")
    tokens = prompt(2 * C + 1)
    with Harness(server) as h:
        h.prefill("a", tokens, blocks(0, 9))
        h.matched("b", tokens)
        h.client.end_session(h.side.session_id("b"))
        stats = h.stats()
        assert stats.num_locks == 2 and stats.num_sessions == 0
        deadline = time.monotonic() + 10
        while h.stats().num_locks and time.monotonic() < deadline:
            time.sleep(0.1)
        stats = h.stats()
        assert stats.num_locks == 0 and stats.expired_locks == 2


def test_retrieve_releases_its_locks_even_when_it_fails(server, mode):
    tokens = prompt(3 * C + 1)
    with Harness(server, transfer_mode=mode) as h:
        h.prefill("a", tokens, blocks(0, 13))
        h.matched("b", tokens)
        plan = h.allocate("b", blocks(40, 13), 3 * C)
        (op,) = plan.retrieves
        out_of_range = blocks(10_000, 12)  # the copy into these blocks fails
        plan.retrieves[0] = dataclasses.replace(op, block_ids=out_of_range)
        assert h.stats().num_locks == 3
        (outcome,) = h.load(plan)
        assert outcome.finished == {"b"}
        assert outcome.failed_block_ids == set(out_of_range)
        assert_quiescent(h.stats())


def test_locked_chunks_survive_capacity_pressure_and_lru_goes_first(start_server):
    object_bytes = C * 128  # 2 layers x K/V x 2 heads x 8 dims x fp16 per token
    server = start_server("--chunk-size", str(C), "--capacity", str(5 * object_bytes))
    with Harness(server) as h:
        for i in range(5):
            h.prefill(f"p{i}", prompt(C + 1, offset=1000 * i), blocks(0, 5))
        h.matched("holder", prompt(C + 1, offset=0))  # locks p0's chunk
        h.matched("toucher", prompt(C + 1, offset=1000))  # refreshes p1, then frees it
        h.allocate("toucher", blocks(0, 5), 0)
        h.side.request_finished("toucher")
        for i in range(5, 8):
            h.prefill(f"p{i}", prompt(C + 1, offset=1000 * i), blocks(0, 5))
            assert h.stats().used_bytes <= 5 * object_bytes
        # p0 is locked and p1 was refreshed: p2, p3, p4 went first, in LRU order.
        assert _present(h, range(9), "first") == {0, 1, 5, 6, 7}
        h.prefill("p8", prompt(C + 1, offset=8000), blocks(0, 5))
        # The check refreshed 0, 1, 5, 6, 7 in that order; 0 is still locked, so 1 goes.
        assert _present(h, range(9), "second") == {0, 5, 6, 7, 8}
        stats = h.stats()
        assert stats.evicted_objects == 4 and stats.used_bytes == 5 * object_bytes
        assert stats.num_locks == 1  # the holder's


def _present(h: Harness, indices, tag: str) -> set[int]:
    found = set()
    for i in indices:
        if h.matched(f"{tag}{i}", prompt(C + 1, offset=1000 * i)) == C:
            found.add(i)
        h.side.request_finished(f"{tag}{i}")  # frees the lookup's locks
    return found


def test_tp2_needs_every_rank_and_mla_stores_one_copy_for_two_readers(server, mode):
    tokens = prompt(2 * C + 3)
    with Harness(server, tp=2, transfer_mode=mode) as h:
        plan = h.compute("only-rank0", 0, 0, [], True)
        h.matched("only-rank0", tokens)
        h.side.update_state_after_alloc("only-rank0", blocks(0, 9), 0)
        plan = h.compute("only-rank0", 0, len(tokens), blocks(0, 9), True)
        h.ranks[0].client.store(plan.stores)  # rank 1 never stores its shard
        h.side.request_finished("only-rank0")
        assert h.matched("probe", tokens) == 0
    with Harness(server, tp=2, mla=True, model="mla-model", transfer_mode=mode) as mla:
        before = mla.stats().num_objects
        mla.prefill("a", tokens, blocks(0, 9))
        assert mla.stats().num_objects - before == 2  # one latent copy, not one per rank
        assert mla.matched("b", tokens) == 2 * C
        plan = mla.allocate("b", blocks(30, 9), 2 * C)
        assert mla.stats().num_locks == 4  # 2 chunks x 2 readers
        rank0, rank1 = mla.ranks
        rank0.client.submit_retrieves(plan.retrieves)
        rank0.client.complete_retrieves(wait_s=5)
        assert mla.stats().num_locks == 2  # still locked for the second reader
        rank1.client.submit_retrieves(plan.retrieves)
        rank1.client.complete_retrieves(wait_s=5)
        assert mla.stats().num_locks == 0
        for rank in (rank0, rank1):  # both ranks got rank 0's latent
            for layer, source in zip(rank.kv.layers, rank0.kv.layers, strict=True):
                assert torch.equal(layer[blocks(30, 8)], source[blocks(0, 8)])


def test_a_chunk_gone_before_retrieve_fails_only_its_blocks(start_server, mode):
    object_bytes = C * 128
    server = start_server(
        "--chunk-size", str(C), "--capacity", str(3 * object_bytes), "--read-lock-ttl", "0.3"
    )
    tokens = prompt(3 * C + 1)
    with Harness(server, transfer_mode=mode) as h:
        h.prefill("a", tokens, blocks(0, 13))
        h.matched("b", tokens)
        plan = h.allocate("b", blocks(40, 13), 3 * C)
        time.sleep(1.0)  # the read locks expire...
        h.prefill("evictor", prompt(C + 1, offset=77), blocks(0, 5))  # ...and chunk 0 goes (LRU)
        (outcome,) = h.load(plan)
        assert outcome.finished == {"b"}
        # Chunk 0 is gone: its blocks must be recomputed. Chunks 1 and 2 still load.
        assert outcome.failed_block_ids == set(blocks(40, 4))
        assert blocks_equal(h.ranks[0].kv, blocks(4, 8), blocks(44, 8))
        assert h.stats().num_locks == 0


@pytest.mark.parametrize("capacity_objects", [3, 7])
def test_bytes_in_use_never_exceed_capacity_under_a_random_workload(start_server, capacity_objects):
    object_bytes = C * 128
    capacity = capacity_objects * object_bytes
    server = start_server("--chunk-size", str(C), "--capacity", str(capacity))
    rng = torch.Generator().manual_seed(capacity_objects)
    with Harness(server) as h:
        for i in range(40):
            docs = int(torch.randint(0, 20, (1,), generator=rng))
            n = int(torch.randint(1, 7, (1,), generator=rng)) * C + 1
            h.prefill(f"r{i}", prompt(n, offset=docs), blocks(0, n // BLOCK_SIZE + 1))
            stats = h.stats()
            assert stats.used_bytes <= capacity
            assert stats.num_locks == 0
        assert h.stats().evicted_objects > 0
