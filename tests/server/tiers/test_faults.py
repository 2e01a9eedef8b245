"""Faults of a disk tier on a real server: a full disk, a read error, a slow disk. Each is a
miss with its cause, counted; never a wrong byte, never a server exit."""

from __future__ import annotations

from pathlib import Path

from server.launch import ServerProcess
from testbed.chaos.mounts import Tmpfs
from testbed.core import protocol as p
from testbed.core.keys import chunk_hashes
from tests.support.cache_harness import connect
from tests.support.quiescence import assert_quiescent
from tests.support.tier_flows import OBJECT_BYTES, C, Worker, below_l1, lookup, stats, until


def prompt(seed: int, chunks: int) -> list[bytes]:
    return chunk_hashes([seed * 100_000 + i for i in range(chunks * C)], C)


def flags(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "--chunk-size", str(C),
        "--capacity", str(16 * OBJECT_BYTES),
        "--tier", f"disk:{64 * OBJECT_BYTES}:{tmp_path / 'l2'}",
        "--lookup-pending-timeout", "30",
        *extra,
    ]  # fmt: skip


def test_a_full_disk_tier_fails_writes_with_their_cause_and_the_server_goes_on(
    private_mounts, tmp_path
):
    (tmp_path / "l2").mkdir()
    small = private_mounts.wrapper([Tmpfs(tmp_path / "l2", 5 * OBJECT_BYTES)])
    args = [*flags(tmp_path), "--token-file", str(tmp_path / "tokens.json")]
    hashes = prompt(1, 8)
    with ServerProcess(args, wrapper=small, log_path=tmp_path / "server.log") as server:
        with (
            Worker(server) as worker,
            connect(server, role="scheduler") as scheduler,
            connect(server, admin=True) as admin,
        ):
            worker.store("a", hashes)
            tier = until(scheduler, lambda s: s.tiers[0].writes + s.tiers[0].failures == 8)
            tier_stats = tier.tiers[0]
            assert tier_stats.failures_by_cause.get("full", 0) >= 1 and tier_stats.writes >= 1
            assert tier_stats.num_objects == tier_stats.writes  # a failed write holds nothing
            admin.call(p.DropObjects(chunk_hashes=hashes))
            hit = lookup(scheduler, "again", hashes)
            assert hit.hit_chunks == sum(hit.hit_chunks_by_tier.values()) <= tier_stats.writes
            assert stats(scheduler).errors == 0
            assert_quiescent(stats(scheduler))
        assert server.close() == 0


def test_a_read_error_is_a_miss_with_its_cause(start_server, tmp_path):
    server = start_server(*flags(tmp_path))
    hashes = prompt(1, 2)
    with below_l1(server, hashes) as (_, scheduler):
        for path in (tmp_path / "l2").glob("*.kv"):
            path.unlink()  # gone behind the server's back
        missed = lookup(scheduler, "r", hashes)
        assert missed.hit_chunks == 0 and missed.miss_status == "tier_read_failed"
        current = stats(scheduler)
        assert current.tier_read_failures == 1
        assert current.tiers[0].failures_by_cause == {"io_error": 2}
        assert current.tiers[0].num_objects == 0  # unreadable: forgotten, not matched again
        assert lookup(scheduler, "r2", hashes).miss_status == "absent"
        assert_quiescent(stats(scheduler))


def test_a_slow_disk_past_the_prefetch_timeout_is_a_prefetch_timeout_miss(start_server, tmp_path):
    server = start_server(*flags(tmp_path, "--tier-delay", "1", "--prefetch", "timeout:0.2"))
    hashes = prompt(1, 1)
    with below_l1(server, hashes) as (_, scheduler):
        late = lookup(scheduler, "r", hashes)
        assert late.hit_chunks == 0 and late.miss_status == "prefetch_timeout"
        assert stats(scheduler).prefetch_timeouts == 1
        until(scheduler, lambda s: s.tiers[0].promotions == 1)  # it arrives, for later lookups
        assert lookup(scheduler, "r2", hashes).hit_chunks_by_tier == {"host": 1}
        assert_quiescent(stats(scheduler))


def test_best_effort_answers_at_once_and_the_chunk_arrives_for_later(start_server, tmp_path):
    server = start_server(*flags(tmp_path, "--tier-delay", "0.5", "--prefetch", "best_effort"))
    hashes = prompt(1, 1)
    with below_l1(server, hashes) as (_, scheduler):
        first = scheduler.call(
            p.Lookup(session_id="r", model="m", world_size=1, chunk_hashes=hashes)
        )
        assert isinstance(first, p.LookupResult)
        assert not first.pending and first.miss_status == "prefetch_timeout"
        until(scheduler, lambda s: s.tiers[0].promotions == 1)
        assert lookup(scheduler, "r2", hashes).hit_chunks_by_tier == {"host": 1}
        assert_quiescent(stats(scheduler))


def test_a_chunk_l1_evicted_before_its_write_through_completed_is_waited_for_not_lost(
    start_server, tmp_path
):
    # A slow disk: L1 (one chunk) evicts a chunk whose disk write is still in flight. The
    # hierarchy is about to hold it, so a lookup waits for the write (as for a store in
    # flight) and is served from disk, instead of missing a chunk that write-through keeps.
    args = flags(tmp_path, "--tier-delay", "0.5", "--tier-promote", "retain")
    args[args.index("--capacity") + 1] = str(OBJECT_BYTES)
    server = start_server(*args)
    first, second = prompt(1, 1), prompt(2, 1)
    with Worker(server) as worker, connect(server, role="scheduler") as scheduler:
        worker.store("a", first)
        worker.store("b", second)  # evicts the first chunk from L1, its write still queued
        assert stats(scheduler).tiers[0].writes == 0
        reply = lookup(scheduler, "r", first)
        assert reply.hit_chunks_by_tier == {"disk": 1}
        assert_quiescent(stats(scheduler))
