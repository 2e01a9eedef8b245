"""A lower tier in a Redis server: chunk objects shared by every cache server that uses it.

Runs in the cache server process (one :class:`RedisStore` per server; many servers, on one
node or many, may name the same Redis and then share what it holds). It implements the
lower-tier store interface of ``server.tiers.base``: it stores bytes under a chunk's object
key and answers what it holds; which chunks it keeps is the hierarchy's index and policy.

**One Redis value per chunk object** (:mod:`server.tiers.redis_objects`): the object key,
the bytes, and a blake3 digest over both. A read verifies the value names the key asked for
and that the digest matches; anything else is no hit (cause ``corrupt``), never bytes. (The
hierarchy frames and verifies its objects too: this check is the store's own, so that a value
another writer left under the key is caught here and counted as the store's.)

**Capacity, twice.** The testbed's own accounting is :meth:`used_bytes`: the bytes this store
wrote and has not removed or found gone, never more than ``capacity_bytes`` when the
hierarchy keeps to it. Redis enforces its own bound as the store does: ``maxmemory`` with
``maxmemory-policy allkeys-lru`` on the store this testbed starts (``server.tiers.redis_process``
sets both, with headroom for Redis's per-key overhead, so that it evicts only when others
share it or the testbed's accounting is exceeded); a Redis given by URL keeps its own
settings, which :meth:`store_memory` reports. A key Redis evicted (or another server removed)
is found gone at the next read or ``contains``: a miss with cause ``absent`` (``last_miss``;
no failure of the medium, so ``last_failure`` is left as it was), and this store's accounting
drops it (``found_gone``).

**Faults** never block the caller for long and never raise: every command has a socket
timeout (``timeout_s``); a connection error is a miss (or a failed write) with cause
``unavailable``, and for ``retry_after_s`` afterwards the store does not try again (each
operation in that window fails at once, counted), so a dead Redis costs one timeout per
window, not one per chunk. When Redis answers again, reads hit again.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from server.tiers.base import FailureCause
from server.tiers.redis_objects import data_size, decode_object, encode_object, redis_key
from testbed.core.keys import ChunkHash

ReadMiss = Literal["absent", "corrupt", "unavailable"]
"""Why a read gave no bytes: not held (evicted by Redis, removed by another server, never
written), held but not sound for its key, Redis not reachable. ``absent`` is no failure of
the medium, so it leaves ``last_failure`` as it was."""
DEFAULT_TIMEOUT_S = 1.0
"""Socket timeout of every Redis command (connect included)."""
DEFAULT_RETRY_AFTER_S = 0.5
"""How long after a connection error the store fails operations at once, before trying again."""


@dataclass
class RedisStoreStats:
    """What the store did, counted since it opened (the summary's tier traffic)."""

    reads: int = 0
    read_hits: int = 0
    read_bytes: int = 0
    writes: int = 0
    written_bytes: int = 0
    write_failures: int = 0
    removes: int = 0
    found_gone: int = 0
    """Keys this store wrote that Redis no longer held (evicted by Redis, removed by another)."""
    read_misses: dict[str, int] = field(default_factory=dict)
    """Reads that gave no bytes, by :data:`ReadMiss`."""
    connection_errors: int = 0
    refusals: int = 0
    """Commands Redis answered with an error (a write out of memory under ``noeviction``)."""

    def missed(self, cause: ReadMiss) -> None:
        self.read_misses[cause] = self.read_misses.get(cause, 0) + 1


class RedisUnavailable(RuntimeError):
    """Redis could not be reached (within the retry window, or at the last try)."""


class RedisStore:
    """Chunk objects in Redis (module docstring). Thread-safe; a context manager."""

    kind = "remote"
    """The hit-source name of this tier (vLLM's)."""
    shared = True
    """Other servers may write to it: the hierarchy asks it (:meth:`held_size`) for objects
    its own index does not know."""

    def __init__(
        self,
        url: str,
        capacity_bytes: int,
        *,
        namespace: str = "kvtb",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        retry_after_s: float = DEFAULT_RETRY_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        import redis  # the `redis` extra; imported here so the base install needs it only here
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.url = url
        self.capacity_bytes = capacity_bytes
        self.namespace = namespace
        self.retry_after_s = retry_after_s
        self.stats = RedisStoreStats()
        self.last_failure: FailureCause | None = None
        """Why the last failed call failed (``server.tiers.base``); ``None`` before any."""
        self.last_miss: ReadMiss | None = None
        """Why the last read gave no bytes (``None`` when it gave them)."""
        self._clock = clock
        self._down_errors: tuple[type[BaseException], ...] = (
            redis.ConnectionError,
            redis.TimeoutError,
            OSError,
        )
        self._refused_errors: tuple[type[BaseException], ...] = (redis.RedisError,)
        self._client: Any = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),  # one try: the window below is the retry policy
        )
        self._sizes: dict[ChunkHash, int] = {}
        self._used_bytes = 0
        self._down_until = 0.0
        self._lock = threading.Lock()

    # -- the store interface (server.tiers.base) ------------------------------------------------

    def used_bytes(self) -> int:
        return self._used_bytes

    def contains(self, key: ChunkHash) -> bool:
        """Whether Redis holds the key now (False when it cannot be asked)."""
        try:
            present = bool(self._call("exists", redis_key(self.namespace, key)))
        except RedisUnavailable:
            return False
        if not present:
            self._forget(key, gone=True)
        return present

    def read(self, key: ChunkHash) -> bytes | None:
        """The object's bytes, verified; ``None`` with the cause in ``last_miss`` (and in
        ``last_failure`` when the medium failed)."""
        self.stats.reads += 1
        try:
            value = self._call("get", redis_key(self.namespace, key))
        except RedisUnavailable:
            self._miss("unavailable")
            return None
        if value is None:
            self._forget(key, gone=True)
            self._miss("absent")
            # To the hierarchy, which read it because it believed it held, the object is lost:
            # Redis evicted it, restarted empty, or another server removed it.
            self.last_failure = "unavailable"
            return None
        data = decode_object(key, value)
        if data is None:
            self._miss("corrupt")
            return None
        self.stats.read_hits += 1
        self.stats.read_bytes += len(data)
        self.last_miss = None
        return data

    def write(self, key: ChunkHash, data: bytes) -> bool:
        """Stores the object (replacing one under the key); False if Redis refused or is down
        (out of memory under ``noeviction``, unreachable): nothing is accounted then."""
        try:
            self._call("set", redis_key(self.namespace, key), encode_object(key, data))
        except RedisUnavailable:
            self.stats.write_failures += 1
            self.last_failure = "unavailable"
            return False
        with self._lock:
            self._used_bytes += len(data) - self._sizes.get(key, 0)
            self._sizes[key] = len(data)
        self.stats.writes += 1
        self.stats.written_bytes += len(data)
        return True

    def remove(self, key: ChunkHash) -> None:
        """Deletes the object from Redis (also for the other servers that share it)."""
        self._forget(key, gone=False)
        self.stats.removes += 1
        # Gone from the accounting even when Redis is down: its own policy evicts the orphan.
        with contextlib.suppress(RedisUnavailable):
            self._call("delete", redis_key(self.namespace, key))

    def keys(self) -> Iterator[ChunkHash]:
        """The keys this store wrote and holds by its accounting (not the other servers')."""
        with self._lock:
            return iter(list(self._sizes))

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> RedisStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- beyond the interface ------------------------------------------------------------------

    def held_size(self, key: ChunkHash) -> int | None:
        """The size of the data held under ``key`` (by whichever server wrote it), without
        reading it; ``None`` when absent or Redis cannot be asked."""
        try:
            length = int(self._call("strlen", redis_key(self.namespace, key)))
        except RedisUnavailable:
            return None
        return data_size(key, length)

    def store_memory(self) -> dict[str, int | str]:
        """Redis's own view: ``used_memory``, ``maxmemory``, ``maxmemory_policy``, ``evicted_keys``
        (empty when it cannot be asked)."""
        try:
            memory = self._call("info", "memory")
            stats = self._call("info", "stats")
        except RedisUnavailable:
            return {}
        return {
            "used_memory": int(memory.get("used_memory", 0)),
            "maxmemory": int(memory.get("maxmemory", 0)),
            "maxmemory_policy": str(memory.get("maxmemory_policy", "")),
            "evicted_keys": int(stats.get("evicted_keys", 0)),
        }

    # -- internal -----------------------------------------------------------------------------

    def _call(self, command: str, *args: Any) -> Any:
        if self._clock() < self._down_until:
            raise RedisUnavailable(self.url)
        try:
            return getattr(self._client, command)(*args)
        except self._down_errors as error:
            self.stats.connection_errors += 1
            self._down_until = self._clock() + self.retry_after_s
            raise RedisUnavailable(self.url) from error
        except self._refused_errors as error:  # an answer (OOM under noeviction): no window
            self.stats.refusals += 1
            raise RedisUnavailable(self.url) from error

    def _miss(self, cause: ReadMiss) -> None:
        """Counts a read that gave no bytes, and why."""
        self.stats.missed(cause)
        self.last_miss = cause
        if cause != "absent":
            self.last_failure = cause

    def _forget(self, key: ChunkHash, *, gone: bool) -> None:
        with self._lock:
            size = self._sizes.pop(key, None)
            if size is None:
                return
            self._used_bytes -= size
        if gone:
            self.stats.found_gone += 1


def shared_sizes(store: object, keys: Sequence[ChunkHash]) -> list[int] | None:
    """The sizes of ``keys``' data in ``store`` if it is shared (:attr:`RedisStore.shared`) and
    holds every one; ``None`` otherwise (a store of this server's alone never is asked)."""
    if not isinstance(store, RedisStore) or not keys:
        return None
    sizes = [store.held_size(key) for key in keys]
    return None if any(size is None for size in sizes) else sizes  # type: ignore[return-value]
