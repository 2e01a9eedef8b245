"""The tiers' changes in the server's eviction feed, on a real server with a real disk tier:
a lookup that asks (``tier_events``) learns each chunk committed in and removed from the disk,
numbered in the stream of L1's removals; one that does not ask sees L1's removals alone."""

from __future__ import annotations

from testbed.core import protocol as p
from testbed.core.keys import chunk_hashes
from tests.support.cache_harness import connect
from tests.support.tier_flows import OBJECT_BYTES, C, Worker, until


def feed(client, after: int, hashes: list[bytes], tiers: bool) -> p.LookupResult:
    reply = client.call(
        p.Lookup(
            session_id="watch", model="m", world_size=1, chunk_hashes=hashes[:1],
            evictions_after=after, tier_events=tiers,
        )
    )  # fmt: skip
    client.call(p.FreeLocks(session_id="watch", end_token=1 << 40))
    client.call(p.EndSession(session_id="watch"))
    assert isinstance(reply, p.LookupResult) and not reply.pending, reply
    return reply


def test_a_lookup_that_asks_learns_what_the_disk_tier_stored_and_removed(start_server, tmp_path):
    server = start_server(
        "--chunk-size", str(C), "--capacity", str(3 * OBJECT_BYTES),
        "--tier", f"disk:{4 * OBJECT_BYTES}:{tmp_path / 'l2'}",
    )  # fmt: skip
    a = chunk_hashes(list(range(3 * C)), C)
    b = chunk_hashes([100_000 + i for i in range(3 * C)], C)
    with Worker(server) as worker, connect(server, role="scheduler") as scheduler:
        start = scheduler.call(p.GetConfig()).eviction_seq
        worker.store("a", a)
        until(scheduler, lambda s: s.tiers[0].writes == 3)
        worker.store("b", b)  # L1 holds 3: a's go; the disk holds 4: two of a's go there
        until(scheduler, lambda s: s.tiers[0].writes == 6)
        asked = feed(scheduler, start, b, tiers=True)
        plain = feed(scheduler, start, b, tiers=False)
    changes = [(c.chunk_hash, c.medium, c.stored) for c in asked.tier_changes]
    assert changes[:3] == [(h, "disk", True) for h in a]
    stored_later = [h for h, _, stored in changes[3:] if stored]
    removed = [h for h, _, stored in changes[3:] if not stored]
    assert stored_later == b and len(removed) == 2 and set(removed) <= set(a)
    assert {c.chunk_hash for c in asked.evicted} == set(a)  # L1's removals, as before
    numbers = [c.seq for c in asked.evicted] + [c.seq for c in asked.tier_changes]
    assert len(set(numbers)) == len(numbers) == 3 + 8 and asked.eviction_seq == max(numbers)
    seqs = [c.seq for c in asked.tier_changes]
    assert seqs == sorted(seqs)
    assert plain.tier_changes == [] and plain.evicted == asked.evicted
