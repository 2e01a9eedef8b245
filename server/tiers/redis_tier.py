"""The redis tier as the server builds it: a :class:`~server.tiers.redis_store.RedisStore` at the
tier's URL, or at a Redis of the server's own when the tier names none.

Runs in the cache server process, when the service starts. ``redis:4GiB:redis://HOST:PORT``
(or ``unix:///path/redis.sock``) uses that Redis, which other servers may share: it is a
*shared* tier (the hierarchy asks it for what its own index does not know: what the other
servers wrote). ``redis:4GiB`` starts ``redis-server`` in the server's scratch directory
(``server.tiers.redis_process``), stopped when the store closes; a run whose servers must
share one store starts it itself and names its URL in every server's ``--tier``.
"""

from __future__ import annotations

from pathlib import Path

from server.config import ServerConfig
from server.tiers.redis_process import EmbeddedRedis
from server.tiers.redis_store import RedisStore
from server.tiers.spec import TierSpec, tier_name


class OwnedRedisStore(RedisStore):
    """A store on a Redis it started (and stops when it closes)."""

    def __init__(self, redis: EmbeddedRedis, capacity_bytes: int) -> None:
        self.redis = redis
        super().__init__(redis.url, capacity_bytes)

    def close(self) -> None:
        super().close()
        self.redis.stop()


def redis_tier(spec: TierSpec, number: int, config: ServerConfig, scratch: Path) -> RedisStore:
    """The tier's store (``server.tiers.build.STORES['redis']``)."""
    if spec.where is not None:
        return RedisStore(spec.where, spec.capacity_bytes)
    redis = EmbeddedRedis(scratch / tier_name(number), spec.capacity_bytes).start()
    try:
        return OwnedRedisStore(redis, spec.capacity_bytes)
    except BaseException:
        redis.stop()
        raise
