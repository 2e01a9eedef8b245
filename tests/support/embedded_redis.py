"""A real Redis for the tests that need one: skipped, saying how to install it, where it is not."""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest

from server.tiers.redis_process import INSTALL_HINT, EmbeddedRedis, redis_server_path

MISSING_REASON = (
    f"needs redis-server ({INSTALL_HINT}) and the redis client (pip install 'kvtestbed[redis]')"
)
needs_redis = pytest.mark.skipif(
    redis_server_path() is None or importlib.util.find_spec("redis") is None,
    reason=MISSING_REASON,
)


@contextlib.contextmanager
def embedded_redis(directory: Path, capacity_bytes: int = 64 << 20) -> Iterator[EmbeddedRedis]:
    """A started Redis on a unix socket, stopped (with its group) when the test ends."""
    redis = EmbeddedRedis(directory, capacity_bytes)
    try:
        yield redis.start()
    finally:
        redis.stop()
