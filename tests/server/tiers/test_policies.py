"""Each tier policy on a real server with a real disk tier (files under tmp_path), seen
through the raw protocol: where a lookup's chunks were matched (``hit_chunks_by_tier``), what
each tier holds, and when chunks go down."""

from __future__ import annotations

from pathlib import Path

from testbed.core import protocol as p
from testbed.core.keys import chunk_hashes
from testbed.core.rpc import RpcClient
from tests.support.cache_harness import connect
from tests.support.quiescence import assert_quiescent
from tests.support.tier_flows import (
    OBJECT_BYTES,
    C,
    Worker,
    below_l1,
    l2,
    lookup,
    release,
    stats,
    until,
)

L1_CHUNKS = 3


def tiered(start_server, tmp_path: Path, *flags: str, l2_chunks: int = 16):
    return start_server(
        "--chunk-size", str(C),
        "--capacity", str(L1_CHUNKS * OBJECT_BYTES),
        "--tier", f"disk:{l2_chunks * OBJECT_BYTES}:{tmp_path / 'l2'}",
        "--lookup-pending-timeout", "30",
        *flags,
    )  # fmt: skip


def prompt(seed: int, chunks: int = L1_CHUNKS) -> list[bytes]:
    return chunk_hashes([seed * 100_000 + i for i in range(chunks * C)], C)


def test_write_through_puts_every_chunk_below_and_an_l1_miss_hits_the_disk(start_server, tmp_path):
    server = tiered(start_server, tmp_path)
    a, b = prompt(1), prompt(2)
    with Worker(server) as worker, connect(server, role="scheduler") as scheduler:
        worker.store("a", a)
        until(scheduler, lambda s: s.tiers[0].writes == 3)
        assert len(list((tmp_path / "l2").glob("*.kv"))) == 3
        worker.store("b", b)  # L1 holds 3 chunks: a's go
        until(scheduler, lambda s: s.tiers[0].writes == 6)
        hit = lookup(scheduler, "a-again", a)
        assert hit.hit_chunks == 3 and hit.hit_chunks_by_tier == {"disk": 3}
        assert l2(scheduler).promotions == 3 and l2(scheduler).reads == 3
        assert_quiescent(stats(scheduler))


def test_write_back_writes_a_chunk_down_exactly_when_l1_evicts_it(start_server, tmp_path):
    server = tiered(start_server, tmp_path, "--tier-write", "write_back")
    a, b = prompt(1), prompt(2, chunks=1)
    with Worker(server) as worker, connect(server, role="scheduler") as scheduler:
        worker.store("a", a)
        assert lookup(scheduler, "look", a).hit_chunks_by_tier == {"host": 3}
        tier = l2(scheduler)
        assert tier.writes == tier.demotions == tier.num_objects == 0
        worker.store("b", b)  # evicts a's least recent chunk, only that one
        tier = until(scheduler, lambda s: s.tiers[0].write_backs == 1).tiers[0]
        assert tier.demotions == 1 and tier.num_objects == 1
        assert lookup(scheduler, "a-again", a[:1]).hit_chunks_by_tier == {"disk": 1}


def store_past_l1(worker: Worker, scheduler: RpcClient, a: list[bytes], b: list[bytes]) -> None:
    """Stores ``a`` then ``b`` (L1 holds one of them) once all their chunks are written down."""
    worker.store("a", a)
    worker.store("b", b)
    until(scheduler, lambda s: s.tiers[0].writes == 2 * L1_CHUNKS)


def test_selective_writes_a_chunk_down_only_after_n_hits(start_server, tmp_path):
    server = tiered(start_server, tmp_path, "--tier-write", "selective:2")
    a = prompt(1)
    with Worker(server) as worker, connect(server, role="scheduler") as scheduler:
        worker.store("a", a)
        lookup(scheduler, "first", a)
        assert l2(scheduler).writes == 0 and l2(scheduler).num_objects == 0
        lookup(scheduler, "second", a)
        until(scheduler, lambda s: s.tiers[0].writes == 3)


def test_promote_none_copies_up_for_one_load_and_retain_keeps_it(start_server, tmp_path):
    for policy, second in (("none", {"disk": 3}), ("retain", {"host": 3})):
        server = tiered(start_server, tmp_path / policy, "--tier-promote", policy)
        a, b = prompt(1), prompt(2)
        with Worker(server) as worker, connect(server, role="scheduler") as scheduler:
            store_past_l1(worker, scheduler, a, b)
            assert lookup(scheduler, "first", a).hit_chunks_by_tier == {"disk": 3}
            if policy == "none":  # gone from L1 once its load's locks went (b's made room)
                until(scheduler, lambda s: s.num_objects == 0)
            assert lookup(scheduler, "second", a).hit_chunks_by_tier == second, policy


def test_a_locked_chunk_is_not_demoted_away(start_server, tmp_path):
    server = tiered(start_server, tmp_path, "--tier-write", "write_back")
    a, b = prompt(1), prompt(2)
    with Worker(server) as worker, connect(server, role="scheduler") as scheduler:
        worker.store("a", a)
        held = lookup(scheduler, "holder", a, end=False)
        assert held.num_locks == 3
        done = worker.store("b", b)  # no room: every L1 object is locked
        assert done.num_committed == 0
        assert l2(scheduler).demotions == 0
        assert lookup(scheduler, "other", a).hit_chunks_by_tier == {"host": 3}
        release(scheduler, "holder")
        assert_quiescent(stats(scheduler))


def test_a_chunk_being_read_from_l2_is_not_evicted_there(start_server, tmp_path):
    server = tiered(start_server, tmp_path, "--tier-delay", "3", l2_chunks=1)
    a, c = prompt(1, chunks=1), prompt(3, chunks=1)
    with below_l1(server, a) as (worker, scheduler):  # out of L1, still in L2
        first = scheduler.call(p.Lookup(session_id="r", model="m", world_size=1, chunk_hashes=a))
        assert isinstance(first, p.LookupResult) and first.pending  # its read is slow
        worker.store("c", c)  # write_through wants L2's only slot: a's is being read
        tier = l2(scheduler)
        assert tier.failures_by_cause == {"full": 1} and tier.evictions == 0
        settled = lookup(scheduler, "r2", a)
        assert settled.hit_chunks_by_tier == {"disk": 1}


def test_a_promotion_is_a_commit_in_the_chunk_log_naming_its_tier(start_server, tmp_path):
    from testbed.analysis.chunklog import load_chunk_log

    run_dir = tmp_path / "run"
    server = tiered(start_server, tmp_path, "--run-dir", str(run_dir))
    a, b = prompt(1), prompt(2)
    with Worker(server) as worker, connect(server, role="scheduler") as scheduler:
        store_past_l1(worker, scheduler, a, b)
        assert lookup(scheduler, "again", a).hit_chunks_by_tier == {"disk": 3}
    server.close()
    log = load_chunk_log(run_dir)
    promoted = log[(log["event"] == "commit") & (log["cause"] == "tier_promote")]
    assert sorted(promoted["chunk_hash"]) == sorted(a)
    assert set(promoted["status"]) == {"disk"}


def test_past_the_bound_on_prefetches_the_hit_ends_with_a_prefetch_timeout(start_server, tmp_path):
    from testbed.analysis.chunklog import load_chunk_log

    run_dir = tmp_path / "run"
    flags = ("--max-prefetch-objects", "1", "--run-dir", str(run_dir))
    server = tiered(start_server, tmp_path, *flags)
    a, b = prompt(1), prompt(2)
    with Worker(server) as worker, connect(server, role="scheduler") as scheduler:
        store_past_l1(worker, scheduler, a, b)
        hit = lookup(scheduler, "again", a)
        assert hit.hit_chunks_by_tier == {"disk": 1} and hit.miss_status == "prefetch_timeout"
        assert stats(scheduler).prefetch_timeouts == 1
    server.close()
    # The chunk log says so too, for every chunk the disk held and no prefetch brought in (the
    # run's token causes read it: prefetch_timeout, not capacity).
    log = load_chunk_log(run_dir)
    rows = log[(log["event"] == "lookup") & log["session_id"].astype(str).str.endswith("again")]
    statuses = rows.sort_values("position")["status"].astype(str).tolist()
    assert statuses == ["hit", "prefetch_timeout", "prefetch_timeout"]
