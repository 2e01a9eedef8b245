"""The cache server's Prometheus endpoint: ``kvtb server --metrics-port N`` serves the
standard ``prometheus_client`` exposition at ``http://HOST:N/metrics``.

Every metric is defined in METRICS.md ("Cache server metrics"); :data:`COUNTERS` and
:data:`GAUGES` name them and the :class:`~testbed.core.protocol.ServerStats` field each reads,
so that what ``GetStats`` answers and what Prometheus scrapes are one set of numbers. Tiers
are read generically: every entry of ``ServerStats.tier_usage`` is one ``tier`` label value.

Threads: the HTTP server runs in a thread of its own; the server's state is only ever read in
the server's loop. A scrape asks the loop for a snapshot (:class:`StatsBridge`), which the
loop answers between two batches of requests (within its poll interval, 100 ms at most), so
a scrape sees the numbers of one instant and never races the loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from server.metrics_bridge import StatsBridge
from testbed.core import protocol as p

PREFIX = "kvtb_server_"
COUNTERS: dict[str, tuple[str, str]] = {
    "lookups": ("lookups", "Lookups answered."),
    "lookup_hit_chunks": ("lookup_hit_chunks", "Chunks the answered lookups found."),
    "lookup_miss_chunks": (
        "lookup_miss_chunks",
        "Chunks the answered lookups asked for beyond their hit prefix.",
    ),
    "mirror_answers": ("mirror_answers", "Lookups a scheduler's mirror answered itself."),
    "mirror_wrong": (
        "mirror_wrong",
        "Mirror answers under what the server held (the engine recomputed cached chunks).",
    ),
    "stored_bytes": ("stored_bytes", "Bytes of the objects stores committed."),
    "retrieved_bytes": ("retrieved_bytes", "Bytes of the objects retrieves read."),
    "evicted_objects": ("evicted_objects", "Objects evicted for capacity."),
    "evicted_bytes": ("evicted_bytes", "Bytes of the objects evicted for capacity."),
    "expired_locks": ("expired_locks", "Read locks released by their TTL."),
    "expired_ops": ("expired_operations", "Stores and retrieves ended by their TTL."),
    "aborted_ops": ("aborted_operations", "Stores and retrieves their client aborted."),
    "refused_quotas": ("quota_refusals", "Requests refused for a client's quota."),
    "refused_limits": ("limit_refusals", "Requests refused for a server-wide limit."),
    "unauthorized": ("unauthorized", "Requests without a valid credential."),
    "dropped_frames": ("dropped_frames", "Replies dropped: the client's queue was full."),
    "chunk_events_dropped": ("chunk_events_dropped", "Chunk log rows lost."),
}
"""``ServerStats`` field -> (metric name without prefix and ``_total``, help)."""
GAUGES: dict[str, tuple[str, str]] = {
    "num_locks": ("locks", "Read locks held."),
    "num_lock_groups": ("lock_groups", "Groups of read locks held (one per answered lookup)."),
    "num_pins": ("pins", "Objects pinned by retrieves in flight."),
    "num_sessions": ("sessions", "Sessions open."),
    "num_clients": ("clients", "Clients connected."),
    "num_workers": ("workers", "Workers registered."),
    "index_bytes": ("index_bytes", "Estimated memory of the index outside the pool."),
}
"""``ServerStats`` field -> (metric name without prefix, help)."""
IN_FLIGHT = {
    "lookup": "num_pending_lookups",
    "store": "num_inflight_stores",
    "retrieve": "num_inflight_retrieves",
}
"""``op`` label of ``kvtb_server_operations_in_flight`` -> its ``ServerStats`` field."""
TIER_GAUGES = {
    "used_bytes": ("tier_used_bytes", "Bytes of the objects a tier holds."),
    "num_objects": ("tier_objects", "Objects a tier holds."),
    "capacity_bytes": ("tier_capacity_bytes", "A tier's capacity in bytes."),
}
"""``TierUsage`` field -> (metric name without prefix, help), labelled by ``tier``."""


class ServerCollector:
    """A ``prometheus_client`` collector over the server's stats (see the module docstring)."""

    def __init__(self, read: Callable[[], p.ServerStats | None]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        stats = self._read()
        if stats is None:  # the loop did not answer: no numbers rather than stale ones
            return
        yield from families(stats)


def families(stats: p.ServerStats) -> Iterator[Metric]:
    """The metric families of one snapshot."""
    for field, (name, text) in COUNTERS.items():
        yield CounterMetricFamily(PREFIX + name, text, value=getattr(stats, field))
    errors = CounterMetricFamily(PREFIX + "errors", "Error replies, by code.", labels=["code"])
    for code, count in sorted(stats.errors_by_code.items()):
        errors.add_metric([code], count)
    yield errors
    for field, (name, text) in GAUGES.items():
        yield GaugeMetricFamily(PREFIX + name, text, value=getattr(stats, field))
    in_flight = GaugeMetricFamily(
        PREFIX + "operations_in_flight", "Operations in flight, by kind.", labels=["op"]
    )
    for op, field in IN_FLIGHT.items():
        in_flight.add_metric([op], getattr(stats, field))
    yield in_flight
    for field, (name, text) in TIER_GAUGES.items():
        family = GaugeMetricFamily(PREFIX + name, text, labels=["tier"])
        for tier in stats.tier_usage:
            family.add_metric([tier.tier], getattr(tier, field))
        yield family


def metric_names() -> list[str]:
    """Every metric's name as Prometheus stores it (counters with ``_total``)."""
    counters = [PREFIX + name + "_total" for name, _ in COUNTERS.values()]
    gauges = [PREFIX + name for name, _ in (*GAUGES.values(), *TIER_GAUGES.values())]
    return [*counters, PREFIX + "errors_total", *gauges, PREFIX + "operations_in_flight"]


class MetricsEndpoint:
    """The HTTP server of ``/metrics`` on ``host:port`` (0: a free port); :attr:`url` is where
    it listens. Context manager: :meth:`close` stops it."""

    def __init__(self, host: str, port: int, bridge: StatsBridge) -> None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(ServerCollector(bridge.read))
        self._server: Any
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        self.url = f"http://{host}:{self._server.server_port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)

    def __enter__(self) -> MetricsEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
