"""The run's own Redis, for redis tiers that name no URL: one store every server of the run
shares (a fleet's per-instance servers included), started before them and stopped after.

Runs in the ``kvtb run`` process. ``redis:4GiB`` becomes ``redis:4GiB:unix://SOCKET`` of a
``redis-server`` the run starts (``server.tiers.redis_process``: a unix socket, no TCP port;
``maxmemory`` from the tier's capacity, ``allkeys-lru``); a tier that names its URL is left as
it is. Without ``redis-server`` the run stops before it starts anything, saying how to install
it.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import msgspec

from server.tiers.redis_process import EmbeddedRedis
from server.tiers.spec import TierSpec, format_tier, parse_tier


def with_run_redis(tiers: list[str], run_dir: Path, stack: ExitStack) -> list[str]:
    """``tiers`` with every redis tier that names no URL pointed at the run's own Redis
    (started here, stopped by ``stack``; one, sized by the largest such tier)."""
    specs = [parse_tier(text) for text in tiers]
    own = [spec for spec in specs if spec.kind == "redis" and spec.where is None]
    if not own:
        return list(tiers)
    redis = EmbeddedRedis(run_dir / "redis", max(spec.capacity_bytes for spec in own))
    stack.callback(redis.stop)
    redis.start()
    return [
        text if spec not in own else format_tier(_at(spec, redis.url))
        for text, spec in zip(tiers, specs, strict=True)
    ]


def _at(spec: TierSpec, url: str) -> TierSpec:
    return msgspec.structs.replace(spec, where=url)
