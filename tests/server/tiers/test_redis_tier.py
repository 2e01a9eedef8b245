"""The redis tier on real cache servers and a real Redis: chunks one server writes through to
the shared store are hit by another server (adopted from the store, prefetched, loaded with
the writer's bytes); the store killed is counted misses and failed writes, never an error or
a wrong byte; started again (empty), what is written anew is hit again. A server given a
redis tier without a URL starts and stops a Redis of its own."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from server.tiers.redis_process import EmbeddedRedis
from tests.support.cache_harness import BLOCK_SIZE, Harness, hit_and_load
from tests.support.embedded_redis import embedded_redis, needs_redis
from tests.support.quiescence import assert_quiescent
from tests.support.tier_flows import until

pytestmark = needs_redis

C = 64
BLOCKS = 3 * C // BLOCK_SIZE + 1
STORED = 3 * C // BLOCK_SIZE


def tokens(seed: int) -> list[int]:
    return [(seed * 7919 + 31 * i) % 30_000 for i in range(3 * C + 7)]


def tiered(start_server, tier: str):
    return start_server(
        "--chunk-size", str(C), "--capacity", "16MiB", "--tier", tier,
        "--lookup-pending-timeout", "30",
    )  # fmt: skip


@contextlib.contextmanager
def written_through(
    start_server, tmp_path: Path
) -> Iterator[tuple[EmbeddedRedis, Harness, Harness]]:
    """A Redis shared by two servers, a writer and a reader on each, once the writer's prompt
    (``tokens(1)``) is written through to the store."""
    with embedded_redis(tmp_path / "redis") as redis:
        a = tiered(start_server, f"redis:64MiB:{redis.url}")
        b = tiered(start_server, f"redis:64MiB:{redis.url}")
        with Harness(a, chunk_size=C, seed=1) as writer, Harness(b, chunk_size=C, seed=2) as reader:
            writer.prefill("w", tokens(1), list(range(BLOCKS)))
            until(writer.rpc, lambda s: s.tiers[0].writes == 3)
            yield redis, writer, reader


def same_blocks(writer: Harness, reader: Harness, source: list[int], target: list[int]) -> bool:
    w, r = writer.ranks[0].kv, reader.ranks[0].kv
    return all(
        torch.equal(
            a.index_select(w.block_dim, torch.tensor(source)),
            b.index_select(r.block_dim, torch.tensor(target)),
        )
        for a, b in zip(w.layers, r.layers, strict=True)
    )


def test_what_one_server_writes_through_another_hits(start_server, tmp_path: Path) -> None:
    with written_through(start_server, tmp_path) as (_, writer, reader):
        target = list(range(60, 60 + BLOCKS))
        assert hit_and_load(reader, "r", tokens(1), target) == 3 * C
        assert same_blocks(writer, reader, list(range(STORED)), target[:STORED])
        tier = reader.stats().tiers[0]
        assert tier.kind == "remote" and tier.adopted == 3 and tier.promotions == 3
        assert_quiescent(reader.stats())


def test_a_killed_store_is_counted_misses_and_a_restarted_one_hits_again(
    start_server, tmp_path: Path
) -> None:
    with written_through(start_server, tmp_path) as (redis, writer, reader):
        redis.kill()
        assert reader.matched("r", tokens(1)) == 0  # the store cannot be asked: a miss
        reader.side.request_finished("r")
        writer.prefill("w2", tokens(2), list(range(20, 20 + BLOCKS)))
        until(writer.rpc, lambda s: s.tiers[0].failures >= 3)
        failed = writer.stats().tiers[0]
        assert failed.failures_by_cause.get("unavailable", 0) == failed.failures >= 3
        redis.start()  # empty: what it held died with it
        seed = store_anew(writer)
        assert reader.matched("r2", tokens(seed)) == 3 * C
        reader.side.request_finished("r2")
        assert_quiescent(reader.stats())
        assert_quiescent(writer.stats())


def store_anew(writer: Harness, timeout_s: float = 30.0) -> int:
    """Stores new prompts until one's chunks are all written through (the store tries Redis
    again once its retry window has passed); that prompt's seed."""
    deadline = time.monotonic() + timeout_s
    seed = 2
    while True:
        seed += 1
        before = writer.stats().tiers[0]
        writer.prefill(f"w{seed}", tokens(seed), list(range(40, 40 + BLOCKS)))
        settled = before.writes + before.failures + 3
        after = until(writer.rpc, lambda s, n=settled: s.tiers[0].writes + s.tiers[0].failures >= n)
        after = after.tiers[0]
        if after.writes == before.writes + 3:
            return seed
        assert time.monotonic() < deadline, "the restarted store took no write"


def test_a_redis_tier_without_a_url_runs_a_redis_of_its_own(start_server, tmp_path) -> None:
    server = tiered(start_server, "redis:64MiB")
    with Harness(server, chunk_size=C) as h:
        h.prefill("w", tokens(1), list(range(BLOCKS)))
        until(h.rpc, lambda s: s.tiers[0].writes == 3)
        assert h.stats().tiers[0].kind == "remote"
    assert EmbeddedRedis  # stopped with the server: the session's leak check proves it
