"""Removals from the cache reach the clients that ask, numbered and in order.

A scheduler announcing what the cache holds (vLLM's KV events) must learn of every chunk the
server evicts or drops, whoever's store caused it, from the lookup replies it reads anyway.
"""

from __future__ import annotations

from server.eviction_feed import EvictionFeed, FeedSlice
from server.objects import ObjectKey
from testbed.core import protocol as p
from testbed.core.keys import chunk_hashes
from tests.support.cache_harness import Harness, connect


def keys(model: str, world: int, *hashes: bytes, salt: str = "") -> list[ObjectKey]:
    return [ObjectKey(model, world, rank, h, salt) for h in hashes for rank in range(world)]


def test_the_feed_numbers_each_chunk_once_and_pages_by_namespace():
    feed = EvictionFeed(max_entries=8)
    assert feed.since(0, "m", 2, 10) == FeedSlice([], 0, lost=False)
    feed.record(keys("m", 2, b"a", b"b"))  # two ranks each: one entry per chunk
    feed.record(keys("other", 2, b"c"))
    feed.record(keys("m", 2, b"d", salt="tenant"))
    assert feed.since(0, "m", 2, 10).chunks == [(1, "", b"a"), (2, "", b"b"), (4, "tenant", b"d")]
    everything = feed.since(1, "m", 2, 10)  # after the first removal
    assert everything.chunks == [(2, "", b"b"), (4, "tenant", b"d")] and everything.seq == 4
    page = feed.since(1, "m", 2, 1)
    assert page.chunks == [(2, "", b"b")] and page.seq == 3  # the rest from 3 on
    assert feed.since(page.seq, "m", 2, 1).chunks == [(4, "tenant", b"d")]


def test_a_client_too_far_behind_or_ahead_is_told_its_knowledge_is_lost():
    feed = EvictionFeed(max_entries=2)
    feed.record(keys("m", 1, b"a", b"b", b"c", b"d"))  # the two oldest are forgotten
    assert feed.since(1, "m", 1, 10).lost  # it would need removal 2, forgotten
    assert feed.since(2, "m", 1, 10).chunks == [(3, "", b"c"), (4, "", b"d")]
    ahead = feed.since(9, "m", 1, 10)  # ahead of the server: it restarted
    assert ahead.lost and ahead.seq == 4


def test_lookups_learn_the_evictions_another_clients_stores_caused(start_server):
    chunk = 64
    object_bytes = chunk * 128  # the harness's KV: 2 layers x 64 bytes per token
    server = start_server("--chunk-size", str(chunk), "--capacity", str(4 * object_bytes))
    old = [(11 * i) % 30_000 for i in range(4 * chunk + 1)]
    new = [(13 * i + 5) % 30_000 for i in range(3 * chunk + 1)]
    with Harness(server) as writer, connect(server) as watcher:

        def lookup(after: int) -> p.LookupResult:
            request = p.Lookup(
                session_id="watch",
                model="tiny",
                world_size=1,
                chunk_hashes=chunk_hashes(old, chunk)[:1],
                evictions_after=after,
            )
            reply = watcher.call(request)
            watcher.call(p.EndSession(session_id="watch"))
            assert isinstance(reply, p.LookupResult)
            return reply

        writer.prefill("old", old, list(range(17)))
        start = watcher.call(p.GetConfig()).eviction_seq  # where a new client starts
        first = lookup(start)
        assert first.evicted == [] and not first.evictions_lost
        writer.prefill("new", new, list(range(20, 33)))  # room for 4: evicts 3 of old's
        later = lookup(first.eviction_seq)
        evicted = {chunk.chunk_hash for chunk in later.evicted}
        assert len(evicted) == 3 and evicted <= set(chunk_hashes(old, chunk))
        assert [c.seq for c in later.evicted] == sorted(c.seq for c in later.evicted)
        assert later.eviction_seq == max(c.seq for c in later.evicted)
        assert lookup(later.eviction_seq).evicted == []  # nothing twice
        assert writer.stats().evicted_objects == 3
