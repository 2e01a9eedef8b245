"""What the server says about itself, and its administration: ping, heartbeat, configuration,
statistics, and dropping stored chunks (admin credential).

Runs in the cache server process; :class:`Admin`'s handlers take their own request types
(routed by ``server.service``).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from server.context import Call, Shared, Steps
from server.objects import Eviction
from server.sessions import Sessions
from server.state import CLIENT_INDEX_BYTES
from testbed.core import protocol as p
from testbed.core.quiescence import Quiescence

SERVER_VERSION = "kvtestbed-server/2"


class Admin:
    """Reads the shared state and the sessions; ``quiescence`` says what is still held."""

    def __init__(
        self, shared: Shared, sessions: Sessions, quiescence: Callable[[], Quiescence]
    ) -> None:
        self.s = shared
        self.sessions = sessions
        self.quiescence = quiescence

    def ping(self, call: Call, req: p.Ping) -> p.Reply:
        return p.Pong(server_version=SERVER_VERSION, pid=os.getpid())

    def ack(self, call: Call, req: p.Heartbeat) -> p.Reply:
        return p.Ack()

    def get_config(self, call: Call, req: p.GetConfig) -> p.Reply:
        c = self.s.config
        return p.ServerConfigInfo(
            chunk_size=c.chunk_size,
            capacity_bytes=c.capacity_bytes,
            policy=c.policy,
            metadata_only=c.metadata_only,
            read_lock_ttl_s=c.read_lock_ttl_s,
            session_ttl_s=c.session_ttl_s,
            op_ttl_s=c.op_ttl_s,
            max_chunks_per_request=c.max_chunks_per_request,
            min_object_bytes=c.min_object_bytes,
            eviction_seq=self.s.evictions.seq,
            pool_medium=None if self.s.pool is None else self.s.pool.medium,
            lookups_fill_l1=self.s.tiers.enabled,
        )

    def get_stats(self, call: Call, req: p.GetStats) -> p.Reply:
        self.s.chunk_log.flush()  # so that its count of rows it could not write is current
        return self.stats()

    def stats(self) -> p.ServerStats:
        """The server's state and counters (every tier's usage among them)."""
        s = self.s
        c = s.counters
        quiet = self.quiescence()
        lower = s.tiers.stats()
        return p.ServerStats(
            num_objects=len(s.cache),
            used_bytes=s.cache.used_bytes,
            capacity_bytes=s.cache.capacity_bytes,
            num_locks=quiet.num_locks,
            num_lock_groups=len(s.cache.groups),
            num_pins=quiet.num_pins,
            num_sessions=len(self.sessions.live),
            num_clients=len(s.clients),
            num_workers=sum(1 for client in s.clients.values() if client.worker is not None),
            num_pending_lookups=quiet.num_pending_lookups,
            num_inflight_stores=quiet.num_inflight_stores,
            num_inflight_retrieves=quiet.num_inflight_retrieves,
            num_tracked_chunks=self.sessions.tracked_chunks + s.cache.locked_chunks,
            index_bytes=(
                s.cache.index_bytes()
                + self.sessions.index_bytes()
                + len(s.clients) * CLIENT_INDEX_BYTES
            ),
            evicted_objects=c.evicted_objects,
            evicted_bytes=c.evicted_bytes,
            expired_locks=c.expired_locks,
            expired_ops=c.expired_ops,
            aborted_ops=c.aborted_ops,
            stored_bytes=c.stored_bytes,
            retrieved_bytes=c.retrieved_bytes,
            errors=c.errors,
            unauthorized=c.unauthorized,
            forbidden=c.forbidden,
            refused_limits=c.refused_limits,
            dropped_frames=c.dropped_frames,
            refused_quotas=c.refused_quotas,
            chunk_events_dropped=s.chunk_log.dropped_rows,
            chunk_events_pending=s.chunk_log.pending_rows,
            tiers=lower,
            peers=self.sessions.peering.stats if self.sessions.peering.peers else None,
            prefetch_timeouts=c.prefetch_timeouts,
            tier_read_failures=c.tier_read_failures,
            unauthenticated_closed=c.unauthenticated_closed,
            lookups=c.lookups,
            lookup_hit_chunks=c.lookup_hit_chunks,
            lookup_miss_chunks=c.lookup_miss_chunks,
            mirror_answers=c.mirror_answers,
            mirror_wrong=c.mirror_wrong,
            mirror_wrong_chunks=c.mirror_wrong_chunks,
            mirror_overestimates=c.mirror_overestimates,
            errors_by_code=dict(c.errors_by_code),
            tier_usage=self._tier_usage(lower),
        )

    def _tier_usage(self, lower: list[p.TierStats]) -> list[p.TierUsage]:
        """Every tier's objects and bytes: L1 (``host``), then the tiers below by kind."""
        cache = self.s.cache
        host = p.TierUsage(
            tier="host",
            num_objects=len(cache),
            used_bytes=cache.used_bytes,
            capacity_bytes=cache.capacity_bytes,
        )
        return [host] + [
            p.TierUsage(
                tier=t.kind,
                num_objects=t.num_objects,
                used_bytes=t.used_bytes,
                capacity_bytes=t.capacity_bytes,
            )
            for t in lower
        ]

    def drop_objects(self, call: Call, req: p.DropObjects) -> Steps:
        cache = self.s.cache
        if req.chunk_hashes:
            keys = [k for h in req.chunk_hashes for k in cache.keys_with_hash(h)]
        else:
            keys = [obj.key for obj in cache.objects()]
        eviction = Eviction(reason="drop")
        released = 0
        for key in keys:
            obj = cache.get(key)
            if obj is None or not obj.committed or obj.pins or (obj.locks and not req.force):
                continue
            released += cache.drop(obj, eviction)
            if call.spend():
                yield
        self.s.record_eviction(eviction, req.traceparent)
        return p.Dropped(
            num_objects=len(eviction.objects),
            num_bytes=eviction.nbytes,
            num_locks_released=released,
        )
