"""The server's hierarchy from its configuration: a store per tier (``STORES``, by kind), an
index per tier, the I/O thread; or the null hierarchy when no tier is named.

Runs in the cache server process, when the service starts. A disk tier without a directory
uses ``tier_dir`` (the run's own) or a temporary directory the server removes when it stops.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from server.cache import KVCache
from server.config import ServerConfig
from server.objects import CacheObject, Eviction, ObjectKey
from server.tiers.base import LowerTierStore
from server.tiers.disk import DiskStore
from server.tiers.hierarchy import Hierarchy, Settings, Tier
from server.tiers.io import TierIO
from server.tiers.policies import check_promote, parse_prefetch, parse_write
from server.tiers.redis_tier import redis_tier
from server.tiers.spec import TierSpec, parse_tier, tier_name
from testbed.core import protocol as p
from testbed.core.policies import make_policy

StoreFactory = Callable[[TierSpec, int, ServerConfig, Path], LowerTierStore]


def _disk(spec: TierSpec, number: int, config: ServerConfig, scratch: Path) -> LowerTierStore:
    directory = Path(spec.where) if spec.where else scratch / tier_name(number)
    return DiskStore(
        directory, spec.capacity_bytes, fsync=config.tier_fsync, direct_io=config.tier_direct_io
    )


STORES: dict[str, StoreFactory] = {"disk": _disk, "redis": redis_tier}
"""Tier kind -> its store's factory (a kind without one is refused at start)."""


class NullHierarchy(Hierarchy):
    """No tier below L1: every hook does nothing."""

    def __init__(self) -> None:  # noqa: D107 - nothing to hold
        self.tiers = []
        self.prefetching = {}
        self.transient = {}
        self.read_failed = {}

    @property
    def enabled(self) -> bool:
        return False

    @property
    def busy(self) -> bool:
        return False

    def holder(self, keys: Any) -> int | None:
        return None

    def stored(self, objects: Iterable[CacheObject], parent: str) -> None:
        pass

    def hit(self, objects: Iterable[CacheObject], parent: str) -> None:
        pass

    def evicted(self, eviction: Eviction, parent: str) -> None:
        pass

    def claimed(self, objects: Iterable[CacheObject]) -> None:
        pass

    def release_session(self, session_id: str) -> None:
        pass

    def is_prefetching(self, key: ObjectKey) -> bool:
        return False

    def pump(self) -> tuple[list[Eviction], list[tuple[CacheObject, str]]]:
        return [], []

    def stats(self) -> list[p.TierStats]:
        return []

    def close(self) -> None:
        pass


class OwnedHierarchy(Hierarchy):
    """A hierarchy that also removes its scratch directory when closed."""

    scratch: Path | None = None

    def close(self) -> None:
        super().close()
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)


def make_hierarchy(
    config: ServerConfig,
    l1: KVCache,
    pool: np.ndarray | None,
    clock: Callable[[], float] = time.monotonic,
) -> Hierarchy:
    """The hierarchy ``config.tiers`` names below ``l1`` (the null one for none)."""
    specs = [parse_tier(text) for text in config.tiers]
    if not specs:
        return NullHierarchy()
    owned = config.tier_dir is None
    scratch = Path(tempfile.mkdtemp(prefix="kvtb-tiers-")) if owned else config.tier_dir
    assert scratch is not None
    tiers, stores = [], []
    for number, spec in enumerate(specs):
        factory = STORES.get(spec.kind)
        if factory is None:
            raise ValueError(f"--tier {spec.kind}: this server has no {spec.kind} store")
        stores.append(factory(spec, number, config, scratch))
        index = KVCache(
            spec.capacity_bytes, make_policy(spec.policy), None, clock, config.read_lock_ttl_s
        )
        stats = p.TierStats(
            name=tier_name(number), kind=stores[-1].kind, capacity_bytes=spec.capacity_bytes
        )
        tiers.append(Tier(spec, stores[-1].kind, index, stats))
    settings = Settings(
        write=parse_write(config.tier_write),
        promote=check_promote(config.tier_promote),
        prefetch=parse_prefetch(config.prefetch),
        max_prefetch_objects=config.max_prefetch_objects,
        max_queued_writes=config.max_queued_tier_writes,
    )
    hierarchy = OwnedHierarchy(
        l1, pool, tiers, TierIO(stores, config.tier_delay_s), settings, clock
    )
    hierarchy.scratch = scratch if owned else None
    return hierarchy
