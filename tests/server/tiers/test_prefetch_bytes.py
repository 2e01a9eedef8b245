"""An L2 hit end to end: the connector's workers store seeded KV, L1 forgets it, a later
request's lookup is answered once the server has brought the chunks up from real files, and
the blocks loaded hold exactly the bytes stored. A flipped byte on disk is a miss with its
cause, never a wrong byte."""

from __future__ import annotations

from pathlib import Path

from tests.support.cache_harness import BLOCK_SIZE, Harness, blocks_equal, hit_and_load
from tests.support.quiescence import assert_quiescent
from tests.support.tier_flows import until

C = 64
OBJECT_BYTES = C * 2 * 2 * 2 * 8 * 2  # tokens x layers x (K, V) x heads x dim x fp16
BLOCKS = 3 * C // BLOCK_SIZE + 1


def tokens(seed: int) -> list[int]:
    return [(seed * 7919 + 31 * i) % 30_000 for i in range(3 * C + 7)]


def tiered(start_server, tmp_path: Path, *flags: str):
    return start_server(
        "--chunk-size", str(C),
        "--capacity", str(3 * OBJECT_BYTES),
        "--tier", f"disk:{16 * OBJECT_BYTES}:{tmp_path / 'l2'}",
        "--lookup-pending-timeout", "30",
        *flags,
    )  # fmt: skip


def test_an_l2_hit_is_prefetched_and_loaded_with_the_bytes_stored(start_server, tmp_path):
    server = tiered(start_server, tmp_path)
    with Harness(server, chunk_size=C, timeout_s=30.0) as h:
        h.prefill("a", tokens(1), list(range(BLOCKS)))
        h.prefill("b", tokens(2), list(range(20, 20 + BLOCKS)))  # L1 holds 3 chunks: a's go
        until(h.rpc, lambda s: s.tiers[0].writes == 6)
        target = list(range(60, 60 + BLOCKS))
        assert hit_and_load(h, "a-again", tokens(1), target) == 3 * C
        assert blocks_equal(h.ranks[0].kv, list(range(12)), target[:12])
        tier = h.stats().tiers[0]
        assert tier.promotions == 3 and tier.read_bytes == 3 * OBJECT_BYTES
        assert_quiescent(h.stats())


def test_a_flipped_byte_on_disk_is_a_miss_counted_with_its_cause(start_server, tmp_path):
    server = tiered(start_server, tmp_path)
    with Harness(server, chunk_size=C, timeout_s=30.0) as h:
        h.prefill("a", tokens(1), list(range(BLOCKS)))
        h.prefill("b", tokens(2), list(range(20, 20 + BLOCKS)))
        until(h.rpc, lambda s: s.tiers[0].writes == 6)
        for path in (tmp_path / "l2").glob("*.kv"):  # every chunk's file damaged
            data = bytearray(path.read_bytes())
            data[-1] ^= 0xFF
            path.write_bytes(bytes(data))
        assert h.matched("a-again", tokens(1)) == 0
        h.side.request_finished("a-again")
        stats = h.stats()
        assert stats.tier_read_failures == 1
        assert stats.tiers[0].failures_by_cause.get("corrupt", 0) >= 1
        assert stats.tiers[0].promotions == 0
        assert_quiescent(stats)
