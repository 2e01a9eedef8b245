"""The announcer: which chunks an engine tells vLLM's KV event publisher the cache holds."""

from __future__ import annotations

from connector.kv_events import (
    ChunkAnnouncer,
    ChunkReport,
    medium_tier,
    store_reports,
    tier_medium,
)
from connector.ops import StoreOp

A, B = ("", b"a" * 16), ("", b"b" * 16)


def written(key, rank: int, seq: int, ok: bool = True) -> ChunkReport:
    return ChunkReport(rank, key[0], key[1], ok, seq)


def announcer(writers: int = 1) -> ChunkAnnouncer[str]:
    chunks: ChunkAnnouncer[str] = ChunkAnnouncer(num_writers=writers)
    chunks.planned(A, "stored a", "removed a")
    chunks.planned(B, "stored b", "removed b")
    return chunks


def events(chunks: ChunkAnnouncer[str]) -> list[str]:
    return [event.payload for event in chunks.take()]


def test_a_chunk_is_announced_once_every_writing_rank_stored_it():
    chunks = announcer(writers=2)
    chunks.reported([written(A, rank=0, seq=0)])
    assert events(chunks) == []  # rank 1 has not stored its shard yet
    chunks.reported([written(A, rank=1, seq=0), written(B, rank=0, seq=0, ok=False)])
    assert events(chunks) == ["stored a"] and len(chunks) == 1
    chunks.reported([written(B, rank=1, seq=0)])  # B was not written by rank 0: never
    chunks.planned(A, "stored a again", "removed a")  # already announced: not twice
    chunks.reported([written(A, rank=0, seq=0), written(A, rank=1, seq=0)])
    assert events(chunks) == []


def test_removals_after_the_commit_announce_a_removal_and_older_ones_do_not():
    chunks = announcer()
    chunks.reported([written(A, 0, seq=5), written(B, 0, seq=5)])
    assert events(chunks) == ["stored a", "stored b"]
    chunks.evicted([(*A, 5)])  # numbered at the commit: an earlier copy of the chunk
    assert events(chunks) == []
    chunks.evicted([(*A, 6), (*A, 7)])
    assert events(chunks) == ["removed a"] and len(chunks) == 1
    chunks.forget_all()  # the server restarted
    assert events(chunks) == ["removed b"] and len(chunks) == 0


def test_a_removal_seen_before_the_report_keeps_the_chunk_unannounced():
    chunks = announcer()
    chunks.evicted([(*A, 9)])  # learned from a lookup before the worker's report arrived
    chunks.reported([written(A, 0, seq=8), written(B, 0, seq=10)])
    assert events(chunks) == ["stored b"]


def test_memory_is_bounded_by_announcing_the_oldest_removed():
    chunks: ChunkAnnouncer[str] = ChunkAnnouncer(num_writers=1, max_chunks=2)
    for name in "xyz":
        key = ("", name.encode() * 16)
        chunks.planned(key, f"stored {name}", f"removed {name}")
        chunks.reported([written(key, 0, seq=0)])
    assert events(chunks) == ["stored x", "stored y", "stored z", "removed x"]
    assert len(chunks) == 2


def test_store_reports_say_which_chunks_a_store_wrote():
    op = StoreOp(
        request_id="r",
        session_id="e:r",
        cache_salt="s",
        chunk_hashes=[A[1], B[1]],
        first_chunk=0,
        start_token=0,
        end_token=128,
        block_ids=[0, 1, 2, 3],
    )
    assert store_reports(1, [op], [[object(), None]], seq=3) == [
        ChunkReport(1, "s", A[1], True, 3),
        ChunkReport(1, "s", B[1], False, 3),  # already there, or no room: not this store's
    ]
    assert [r.written for r in store_reports(1, [op], None, seq=3)] == [False, False]


def test_a_tiers_changes_are_announced_under_the_tier_whatever_l1_does():
    chunks = announcer()
    chunks.reported([written(A, 0, seq=1)])
    chunks.tier_changed([("", A[1], "disk", True), ("", b"c" * 16, "disk", True)])
    taken = chunks.take()  # c was never planned here: not announced
    assert [(e.stored, e.payload, e.tier) for e in taken] == [
        (True, "stored a", ""),
        (True, "stored a", "disk"),
    ]
    chunks.evicted([("", A[1], 2)])  # L1 evicts a: the disk still holds it
    chunks.tier_changed([("", A[1], "disk", True)])  # stored again: not twice
    assert [(e.stored, e.tier) for e in chunks.take()] == [(False, "")]
    chunks.tier_changed([("", A[1], "disk", False), ("", A[1], "disk", False)])
    assert [(e.stored, e.payload, e.tier) for e in chunks.take()] == [(False, "removed a", "disk")]
    chunks.tier_changed([("", B[1], "remote", True)])  # planned, not yet stored in L1
    chunks.forget_all()
    assert [(e.stored, e.tier) for e in chunks.take()] == [(True, "remote"), (False, "remote")]


def test_media_name_each_tier_and_only_the_servers():
    assert tier_medium("") == "kvtb" and tier_medium("disk") == "kvtb/disk"
    assert [medium_tier(m) for m in ("kvtb", "kvtb/disk", "kvtb/", "GPU", None)] == [
        "", "disk", None, None, None,
    ]  # fmt: skip
