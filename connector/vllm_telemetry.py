"""The connector in vLLM's own telemetry: connector stats, Prometheus metrics, KV events.

Part of the vLLM shim (imports vLLM; :mod:`connector.vllm_connector` uses it), in every vLLM
process: the stats classes travel from the workers and the scheduler (engine core) to the
API server process, where vLLM builds the Prometheus metrics from this module.

- :class:`KVTBConnectorStats`: one interval of :mod:`connector.stats` in vLLM's
  ``KVConnectorStats``: ``aggregate`` adds counts and concatenates latency samples, so the
  sum over TP workers (vLLM's ``KVOutputAggregator``), the scheduler's lookups and the
  intervals of a logging period are all exact; ``reduce`` is what vLLM logs.
- :class:`KVTBPromMetrics`: ``vllm:kvtb_*`` counters and latency histograms on ``/metrics``
  (METRICS.md, "vLLM's /metrics").
- :class:`KVTBWorkerMetadata`: the workers' per-chunk store reports, to the scheduler side.
- :func:`chunk_events`: a planned store's chunks as vLLM's ``BlockStored`` /
  ``BlockRemoved`` events under vLLM's own block hashes of the chunk's blocks, with
  :data:`MEDIUM` naming the external cache's L1 (:func:`event_of`: a tier below it under its
  own medium, ``kvtb/disk``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
from prometheus_client import Counter, Gauge, Histogram
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)

from connector import stats
from connector.kv_events import MEDIUM as L1_MEDIUM
from connector.kv_events import ChunkAnnouncer, ChunkEvent, ChunkKey, ChunkReport, tier_medium
from connector.ops import StoreOp

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

    from connector.scheduler_client import SchedulerClient

MEDIUM = L1_MEDIUM
"""The ``medium`` of the connector's KV events about the cache server's L1 (a tier below it:
``connector.kv_events.tier_medium``)."""

METRIC_PREFIX = "vllm:kvtb_"

_COUNTER_HELP = {
    "lookups": "Cache server lookups (one per request admission with a complete chunk).",
    "lookup_failures": "Lookups that failed (server down, timed out or refused): misses.",
    "lookup_requested_tokens": "Tokens the lookups asked for (complete chunks).",
    "lookup_hit_tokens": "Tokens the lookups found and locked on the cache server.",
    "stores": "Store batches (one per worker and engine step with chunks to store).",
    "store_failures": "Store batches that did not commit.",
    "stored_bytes": "Bytes the stores committed (every TP rank's shard).",
    "retrieves": "Retrieve batches (one per worker and engine step with chunks to load).",
    "retrieve_failures": "Retrieve batches in which a load failed (vLLM recomputes).",
    "retrieved_bytes": "Bytes the retrieves copied out of the cache (each reading rank).",
    "abandoned_releases": "Releases and aborts sent for operations the connector gave up on.",
}
_HISTOGRAM_HELP = {
    "lookup_s": "Lookup latency: submitted to its answer used (waits and polls included).",
    "store_s": "Store batch latency: reserve, copy into the pool, commit.",
    "retrieve_s": "Retrieve batch latency: request, copy out of the pool, release.",
}
_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass
class KVTBConnectorStats(KVConnectorStats):
    """One interval of the connector's operations (``data``: :mod:`connector.stats`)."""

    def __post_init__(self) -> None:
        self.data = stats.merge(stats.empty(), self.data)  # a copy: vLLM shares the dict

    def reset(self) -> None:
        self.data = stats.empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        stats.merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return stats.summary(self.data)

    def is_empty(self) -> bool:
        return stats.is_empty(self.data)


def connector_stats(data: stats.StatsData | None) -> KVTBConnectorStats | None:
    return None if data is None else KVTBConnectorStats(data=data)


class KVTBPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvtb_*`` on vLLM's ``/metrics``, per engine (vLLM's ``model_name``, ``engine``
    labels): a counter per :data:`connector.stats.COUNTERS` entry, a histogram (seconds) per
    :data:`connector.stats.SAMPLES` entry."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._per_engine(
                self._counter_cls(
                    name=METRIC_PREFIX + name,
                    documentation=_COUNTER_HELP[name],
                    labelnames=labelnames,
                )
            )
            for name in stats.COUNTERS
        }
        histogram: Any = self._histogram_cls  # vLLM types the metric classes as a union
        self._histograms = {
            name: self._per_engine(
                histogram(
                    name=METRIC_PREFIX + name.removesuffix("_s") + "_seconds",
                    documentation=_HISTOGRAM_HELP[name],
                    labelnames=labelnames,
                    buckets=_BUCKETS_S,
                )
            )
            for name in stats.SAMPLES
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, counters in self._counters.items():
            value = transfer_stats_data.get(name, 0)
            if value:
                counters[engine_idx].inc(value)
        for name, histograms in self._histograms.items():
            for seconds in transfer_stats_data.get(name, ()):
                histograms[engine_idx].observe(seconds)

    def _per_engine(self, metric: Counter | Gauge | Histogram) -> dict[int, Any]:
        return {
            index: metric.labels(*labelvalues)
            for index, labelvalues in self.per_engine_labelvalues.items()
        }


@dataclass
class KVTBWorkerMetadata(KVConnectorWorkerMetadata):
    """The chunk reports of one engine step, every worker's (vLLM concatenates them)."""

    reports: list[ChunkReport] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVTBWorkerMetadata)
        self.reports += other.reports
        return self


def announced(announcer: ChunkAnnouncer[Any], client: SchedulerClient) -> list[Any]:
    """The KV events since the last call: the removals and tier changes the client's lookups
    learned, applied to ``announcer``, then its events as vLLM's."""
    evicted, lost = client.take_evictions()
    if lost:
        announcer.forget_all()
    announcer.evicted(evicted)
    announcer.tier_changed(
        (c.cache_salt, c.chunk_hash, c.medium, c.stored) for c in client.take_tier_changes()
    )
    return [event_of(event) for event in announcer.take()]


def event_of(event: ChunkEvent[Any]) -> Any:
    """The vLLM event of an announcement: its payload, under the medium of its tier."""
    if not event.tier:
        return event.payload
    return msgspec.structs.replace(event.payload, medium=tier_medium(event.tier))


def chunk_events(
    request: Request, op: StoreOp, chunk_size: int, hash_block_size: int
) -> Iterator[tuple[ChunkKey, BlockStored, BlockRemoved]]:
    """Per chunk of ``op``: its key and its stored / removed events, under the request's vLLM
    block hashes of the chunk's blocks (as vLLM's own block pool would announce those blocks,
    with their token ids, LoRA adapter and per-block extra keys)."""
    per_chunk = chunk_size // hash_block_size
    lora = request.lora_request
    for index, chunk_hash in enumerate(op.chunk_hashes):
        first = (op.first_chunk + index) * per_chunk
        hashes = request.block_hashes[first : first + per_chunk]
        start, end = first * hash_block_size, (first + per_chunk) * hash_block_size
        if len(hashes) < per_chunk:
            return  # not hashed by vLLM (yet): nothing a router could match
        extra_keys = [
            generate_block_hash_extra_keys(
                request, block * hash_block_size, (block + 1) * hash_block_size, 0
            )[0]
            for block in range(first, first + per_chunk)
        ]
        block_hashes = [maybe_convert_block_hash(h) for h in hashes]
        stored = BlockStored(
            block_hashes=block_hashes,
            parent_block_hash=maybe_convert_block_hash(request.block_hashes[first - 1])
            if first
            else None,
            token_ids=list(request.all_token_ids[start:end]),
            block_size=hash_block_size,
            lora_id=lora.adapter_id if lora else None,
            medium=MEDIUM,
            lora_name=lora.name if lora else None,
            extra_keys=to_event_extra_keys(extra_keys),
            group_idx=0,  # one KV cache group (the connector refuses more)
        )
        removed = BlockRemoved(block_hashes=block_hashes, medium=MEDIUM, group_idx=0)
        yield (op.cache_salt, chunk_hash), stored, removed
