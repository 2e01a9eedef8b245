"""The redis tier's store on a real Redis (started on a unix socket, no TCP port): objects one
server writes are hit by another with verified bytes, a value that is not sound for its key
is never bytes, Redis's own eviction shows in the store's accounting, and a Redis killed and
started again degrades to counted misses and then hits again."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis as redis_client

from server.tiers.base import LowerTierStore
from server.tiers.redis_objects import decode_object, encode_object, redis_key
from server.tiers.redis_process import EmbeddedRedis, RedisMissing, require_redis_server
from server.tiers.redis_store import RedisStore
from testbed.core.keys import ChunkHash
from tests.support.embedded_redis import embedded_redis, needs_redis


def key(index: int) -> ChunkHash:
    return ChunkHash(index.to_bytes(16, "little"))


def payload(index: int, nbytes: int = 4096) -> bytes:
    return bytes((index * 7 + i) % 251 for i in range(nbytes))


class Clock:
    """A clock the test moves, so the store's retry window passes without a sleep."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def store_redis(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    with embedded_redis(tmp_path / "redis") as started:
        yield started


def test_a_value_is_bytes_only_for_its_own_key_and_digest() -> None:
    value = encode_object(key(1), payload(1))
    assert decode_object(key(1), value) == payload(1)
    assert decode_object(key(2), value) is None  # another chunk's value under this key
    flipped = bytearray(value)
    flipped[-1] ^= 1
    assert decode_object(key(1), bytes(flipped)) is None
    assert decode_object(key(1), value[:-1]) is None
    assert decode_object(key(1), value[:10]) is None


@needs_redis
def test_what_one_server_writes_another_hits_with_verified_bytes(
    store_redis: EmbeddedRedis,
) -> None:
    with (
        RedisStore(store_redis.url, 1 << 20) as writer,
        RedisStore(store_redis.url, 1 << 20) as reader,
    ):
        assert isinstance(writer, LowerTierStore) and writer.kind == "remote"
        for index in range(8):
            assert writer.write(key(index), payload(index))
        assert writer.used_bytes() == 8 * 4096 and sorted(writer.keys()) == [
            key(i) for i in range(8)
        ]
        assert reader.used_bytes() == 0  # it holds nothing it wrote
        assert all(reader.contains(key(i)) for i in range(8)) and not reader.contains(key(99))
        assert [reader.read(key(i)) for i in range(8)] == [payload(i) for i in range(8)]
        assert reader.stats.read_hits == 8 and reader.stats.read_bytes == 8 * 4096
        assert reader.read(key(99)) is None and reader.last_miss == "absent"
        writer.remove(key(3))
        assert reader.read(key(3)) is None and writer.used_bytes() == 7 * 4096


@needs_redis
def test_a_corrupted_value_is_a_counted_miss_never_bytes(store_redis: EmbeddedRedis) -> None:
    with RedisStore(store_redis.url, 1 << 20) as store:
        store.write(key(1), payload(1))
        store.write(key(2), payload(2))
        raw = redis_client.Redis.from_url(store_redis.url)
        try:
            stored = raw.get(redis_key("kvtb", key(1)))
            assert isinstance(stored, bytes)
            value = bytearray(stored)
            value[100] ^= 0xFF
            raw.set(redis_key("kvtb", key(1)), bytes(value))
            raw.set(redis_key("kvtb", key(2)), encode_object(key(5), payload(5)))  # misplaced
        finally:
            raw.close()
        assert store.read(key(1)) is None and store.last_failure == "corrupt"
        assert store.read(key(2)) is None and store.stats.read_misses == {"corrupt": 2}


@needs_redis
def test_redis_eviction_shows_in_the_stores_accounting(tmp_path: Path) -> None:
    with (
        embedded_redis(tmp_path / "redis", capacity_bytes=1 << 20) as started,
        RedisStore(started.url, 1 << 30) as store,
    ):
        chunk = 1 << 20
        for index in range(40):  # far beyond maxmemory (1 MiB + headroom)
            assert store.write(key(index), payload(index, 16) * (chunk // 16))
        memory = store.store_memory()
        assert memory["maxmemory_policy"] == "allkeys-lru" and int(memory["evicted_keys"]) > 0
        held = [index for index in range(40) if store.contains(key(index))]
        assert 0 < len(held) < 40
        assert store.stats.found_gone == 40 - len(held)
        assert store.used_bytes() == len(held) * chunk


@needs_redis
def test_a_killed_redis_gives_counted_misses_and_hits_again_once_restarted(
    store_redis: EmbeddedRedis,
) -> None:
    clock = Clock()
    with RedisStore(store_redis.url, 1 << 20, retry_after_s=5.0, clock=clock) as store:
        assert store.write(key(1), payload(1)) and store.read(key(1)) == payload(1)
        store_redis.kill()
        assert store.read(key(1)) is None and store.last_failure == "unavailable"
        assert not store.write(key(2), payload(2)) and not store.contains(key(1))
        assert store.read(key(1)) is None
        # One connection error for the window; the rest failed at once, every one counted.
        assert store.stats.connection_errors == 1
        assert store.stats.read_misses == {"unavailable": 2} and store.stats.write_failures == 1
        store_redis.start()  # empty: what it held died with it
        assert store.read(key(1)) is None and store.last_failure == "unavailable"  # window
        clock.now += 5.0
        assert store.read(key(1)) is None and store.last_miss == "absent"
        assert store.write(key(1), payload(1)) and store.read(key(1)) == payload(1)


def test_a_redis_tier_without_redis_server_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RedisMissing, match="apt-get install redis-server"):
        require_redis_server()
    assert os.environ["PATH"] == str(tmp_path)
