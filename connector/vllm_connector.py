"""``KVTBConnector``: the vLLM ``KVConnectorBase_V1`` shim. The only module importing vLLM.

Installing kvtestbed registers it with vLLM by name (:mod:`connector.plugin`)::

    KVTransferConfig(
        kv_connector="KVTBConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"kvtb.server_url": "tcp://127.0.0.1:5555", ...},
    )

(keys: :class:`connector.config.ConnectorConfig`; without the plugin, add
``kv_connector_module_path="connector.vllm_connector"``). Which hook runs where:

- scheduler process, role SCHEDULER: ``get_num_new_matched_tokens``,
  ``update_state_after_alloc``, ``build_connector_meta``, ``request_finished`` delegate to
  :class:`connector.scheduler.SchedulerSide` after converting vLLM's objects to plain ones;
  ``request_finished`` asks vLLM to keep the blocks of a request whose stores may be in
  flight;
- each worker process, role WORKER: ``register_kv_caches`` registers the paged KV tensors
  with the server (server-driven transfers: after moving them into shared memory);
  ``handle_preemptions`` drops stores of preempted requests not copied yet (before the
  forward pass may reuse their blocks); ``start_load_kv`` starts the step's retrieves (or
  finishes them, with synchronous loads); ``wait_for_save`` starts the stores
  of the step's newly completed chunks without waiting; ``get_finished`` reports completed
  loads and the finished requests whose stores are all done; ``get_block_ids_with_load_errors``
  the blocks whose chunks were gone, which vLLM then recomputes.

The cache is best effort (``requires_kv_delivery`` is False): a dead server means misses and
recomputation, never a hang (every wait is bounded by ``kvtb.mq_timeout_s``).

vLLM sees the connector (:mod:`connector.vllm_telemetry`): its hits count by the tier that
served them (``get_external_cache_hit_sources``); ``get_kv_connector_stats`` and the
classmethods ``build_kv_connector_stats`` / ``build_prom_metrics`` put lookups, bytes,
latencies and failures on ``/metrics``; with ``--kv-events-config`` the workers report each
stored chunk (``build_connector_worker_meta``), ``update_connector_output`` takes the reports
and the failed loads (whose chunks are stored again), and ``take_events`` hands vLLM's KV
event publisher the chunks stored in and removed from the cache server. Pipeline parallelism is
refused at start: the cache keys do not tell PP ranks' layers apart.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import RequestStatus

from connector import tracing, vllm_telemetry
from connector.config import ConnectorConfig, refuse_pipeline_parallelism, server_config
from connector.faults import FaultInjector
from connector.kv_copy import PagedKV
from connector.kv_events import ChunkAnnouncer
from connector.mirror import LookupMirror
from connector.ops import FinishingOrder, StepPlan
from connector.planner import Geometry
from connector.scheduler import SchedulerSide
from connector.scheduler_client import SchedulerClient
from connector.vllm_views import (
    block_dim_of,
    request_view,
    scheduled_requests,
    single_group,
    vllm_hit_sources,
)
from connector.worker_client import WorkerClient
from testbed.core import protocol as p
from testbed.core.credentials import client_token
from testbed.core.ranks import WorkerIdentity, kv_world_size, readers_per_object
from testbed.core.rpc import CurveKeys, RemoteError, RpcClient, ServerUnavailable
from testbed.core.telemetry import attributes as a

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


class KVTBConnectorMetadata(KVConnectorMetadata):
    """The step's plan, from the scheduler side to every worker."""

    def __init__(self, plan: StepPlan) -> None:
        super().__init__()
        self.plan = plan


class KVTBConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.HOST  # a request without a per-tier split

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        self.config = config = ConnectorConfig.from_extra_config(transfer.kv_connector_extra_config)
        self.block_size = vllm_config.cache_config.block_size
        parallel = vllm_config.parallel_config
        refuse_pipeline_parallelism(parallel.pipeline_parallel_size)
        events = vllm_config.kv_events_config
        self._kv_events = events is not None and events.enable_kv_cache_events
        hash_block = kv_cache_config.hash_block_size if kv_cache_config is not None else None
        self._hash_block_size = hash_block or self.block_size
        self.tp_size = parallel.tensor_parallel_size
        self.tp_rank = parallel.rank % self.tp_size
        self.mla = bool(config.mla if config.mla is not None else vllm_config.model_config.use_mla)
        self.model = config.model_name or vllm_config.model_config.model
        scheduler = role == KVConnectorRole.SCHEDULER
        self._traces = tracing.acquire(
            config.span_dir,
            run_id=config.run_id,
            service_name="kvtb-connector",
            rank=None if scheduler else self.tp_rank,
            resource={a.TP_SIZE: self.tp_size, a.MLA: self.mla, a.MODEL: str(self.model)},
        )
        self._curve = None
        if config.curve_secret_key:
            self._curve = CurveKeys(Path(config.curve_secret_key), Path(config.curve_server_key))
        self.rpc = RpcClient(
            config.server_url,
            role="scheduler" if scheduler else f"worker{self.tp_rank}",
            token=client_token(config.token, config.token_file or None),
            timeout_s=config.mq_timeout_s,
            heartbeat_interval_s=config.heartbeat_interval_s,
            curve=self._curve,
        )
        server = server_config(self.rpc, config)
        chunk_size = server.chunk_size if server is not None else config.chunk_size
        self.scheduler_side: SchedulerSide | None = None
        self.worker: WorkerClient | None = None
        self._load_errors: set[int] = set()
        self.announcer: ChunkAnnouncer[KVCacheEvent] | None = None
        self._requests: dict[str, Request] = {}
        """Requests whose stores may still be planned (KV events are built from them)."""
        # Finished requests whose blocks vLLM keeps for our stores, in finishing order: vLLM
        # frees them in the order it reads finished_sending, and that order decides which
        # blocks its own prefix cache evicts first (runs must not depend on set order).
        self._delayed: dict[str, None] = {}
        if scheduler:
            engine_id = config.engine_id or transfer.engine_id or "engine"
            self.scheduler_side = self._scheduler_side(chunk_size, engine_id, server)
        else:
            Geometry(chunk_size, self.block_size)  # validates the block size early
            self.worker = self._worker_client()

    def _scheduler_side(
        self, chunk_size: int, engine_id: str, server: p.ServerConfigInfo | None
    ) -> SchedulerSide:
        config = self.config
        world_size = kv_world_size(self.tp_size, self.mla)
        client = SchedulerClient(
            self.rpc,
            model=self.model,
            world_size=world_size,
            num_readers=readers_per_object(self.tp_size, self.mla),
            chunk_size=chunk_size,
            track_evictions=self._kv_events,
            eviction_seq=server.eviction_seq if server is not None else 0,
            defer_releases=True,
            mirror=LookupMirror(num_writers=world_size) if config.lookup_mirror else None,
        )
        if self._kv_events:
            self.announcer = ChunkAnnouncer(num_writers=world_size)
        return SchedulerSide(
            client,
            Geometry(chunk_size, self.block_size),
            engine_id=engine_id,
            default_cache_salt=config.cache_salt,
            load_async=config.load_async,
            lookup_wait_s=config.lookup_wait_s,
            # Stores on their own timing: a pending answer may wait on this engine's own
            # worker, which runs after the scheduler; vLLM asks again next step.
            wait_pending=config.store_wait_s > 0,
            store_decode_tokens=config.store_decode_tokens,
            tp_size=self.tp_size,
            lookups_fill_l1=server is not None and server.lookups_fill_l1,
        )

    def _worker_client(self) -> WorkerClient:
        config = self.config
        faults = FaultInjector.for_config(config, self.tp_rank, self._curve)
        identity = WorkerIdentity.for_rank(
            self.model, self.tp_size, self.tp_rank, self.mla, transfer_mode=config.transfer_mode
        )
        worker = WorkerClient(self.rpc, identity, faults)
        worker.report_chunks = self._kv_events or config.lookup_mirror
        return worker

    @property
    def requires_kv_delivery(self) -> bool:
        return False

    # -----------------------------------------------------------------------------------------
    # Worker side
    # -----------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        layers = tuple(kv_caches.values())
        num_blocks = self._kv_cache_config.num_blocks if self._kv_cache_config else None
        kv = PagedKV(layers, block_dim_of(layers[0], num_blocks), self.block_size)
        try:
            self.worker.register(kv)
        except (ServerUnavailable, RemoteError) as exc:
            log.warning("could not register KV caches with the cache server: %s", exc)
            self.worker.kv = kv  # registration is retried on the first store or retrieve

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before this step's forward pass may overwrite them: no store copies out of the
        blocks of requests preempted since the last step (server-driven: waits until the
        server's copies of them are done)."""
        if self.worker is not None and isinstance(kv_connector_metadata, KVTBConnectorMetadata):
            self.worker.cancel_stores(kv_connector_metadata.plan.cancelled_request_ids)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.worker is not None
        plan = self._plan()
        self._delayed.update(dict.fromkeys(plan.delayed_request_ids))
        self.worker.progress_stores()
        if plan.retrieves:
            self.worker.submit_retrieves(plan.retrieves)
            if not self.config.load_async:
                # The forward pass comes next: whatever has not arrived by now fails, and is
                # reported by get_block_ids_with_load_errors in this same step.
                outcome = self.worker.complete_retrieves(
                    wait_s=self.config.mq_timeout_s, fail_outstanding=True
                )
                self._load_errors |= outcome.failed_block_ids

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        """Starts the step's stores and returns: the forward pass never waits on the network;
        vLLM keeps a finished request's blocks until its stores are done (request_finished
        returned True, and get_finished reports it in finished_sending)."""
        assert self.worker is not None
        plan = self._plan()
        self.worker.submit_stores(plan.stores)
        self.worker.progress_stores()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self.worker is not None
        self.worker.progress_stores(self.config.store_wait_s)
        pending = self.worker.pending_store_requests
        done = [request_id for request_id in self._delayed if request_id not in pending]
        for request_id in done:
            del self._delayed[request_id]
        sent = FinishingOrder(done)  # a set, as vLLM types it, iterating in finishing order
        recving = None
        if self.config.load_async and self.worker.num_inflight_retrieves:
            outcome = self.worker.complete_retrieves(wait_s=self.config.load_wait_s)
            self._load_errors |= outcome.failed_block_ids
            recving = outcome.finished or None
        return sent or None, recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """:meth:`get_finished` as vLLM's runner takes it, keeping the finishing order that
        the base class's plain sets would lose."""
        sending, recving = self.get_finished(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=sending or FinishingOrder(), finished_recving=set(recving or ())
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> vllm_telemetry.KVTBWorkerMetadata | None:
        """The step's per-chunk store reports (with KV events on), for the scheduler side."""
        if self.worker is None or not self.worker.report_chunks:
            return None
        reports = self.worker.take_chunk_reports()
        return vllm_telemetry.KVTBWorkerMetadata(reports) if reports else None

    def _plan(self) -> StepPlan:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KVTBConnectorMetadata)
        return metadata.plan

    # -----------------------------------------------------------------------------------------
    # Both roles: vLLM's connector stats and Prometheus metrics; shutdown
    # -----------------------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This process's operations since the last call: the worker's stores and retrieves,
        or the scheduler's lookups (vLLM sums them over TP workers and the scheduler)."""
        if self.worker is not None:
            return vllm_telemetry.connector_stats(self.worker.stats.take())
        if self.scheduler_side is not None:
            return vllm_telemetry.connector_stats(self.scheduler_side.client.stats.take())
        return None

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return vllm_telemetry.KVTBConnectorStats(data=data or {})

    @classmethod
    def build_prom_metrics(cls, *args: Any) -> KVConnectorPromMetrics | None:
        """vLLM's arguments (its config, metric classes, label names and values per engine),
        as :class:`~connector.vllm_telemetry.KVTBPromMetrics` takes them."""
        return vllm_telemetry.KVTBPromMetrics(*args)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.scheduler_side is not None:
            self.scheduler_side.close()
        self.rpc.close()
        if self._traces:
            self._traces = False
            tracing.release()

    # -----------------------------------------------------------------------------------------
    # Scheduler side
    # -----------------------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self.scheduler_side is not None
        if self.announcer is not None:
            self._requests[request.request_id] = request
        return self.scheduler_side.get_num_new_matched_tokens(
            request_view(request), num_computed_tokens
        )

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self.scheduler_side is not None
        self.scheduler_side.update_state_after_alloc(
            request.request_id, single_group(blocks.get_block_ids()), num_external_tokens
        )

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        """vLLM's ``prompt_tokens_cached_by_source``: the accepted external hit split by the
        tier the server matched each chunk in (``host`` L1, ``disk``, ``p2p``; a remote
        store has no name of vLLM's and counts as ``external_unspecified``)."""
        assert self.scheduler_side is not None
        split = self.scheduler_side.hit_sources(request.request_id, num_external_tokens)
        return vllm_hit_sources(split)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler_side is not None
        side = self.scheduler_side
        plan = side.build_plan(
            scheduled_requests(scheduler_output), scheduler_output.preempted_req_ids or ()
        )
        if self.announcer is not None:
            for op in plan.stores:
                request = self._requests.get(op.request_id)
                if request is not None:
                    for key, stored, removed in vllm_telemetry.chunk_events(
                        request, op, side.geometry.chunk_size, self._hash_block_size
                    ):
                        self.announcer.planned(key, stored, removed)
            for request_id in plan.delayed_request_ids:  # finished: no store planned after
                self._requests.pop(request_id, None)
        # This step's lock releases (and earlier steps' ends of sessions) before the workers'
        # operations; applied first when stores wait (a replay), so timing decides nothing.
        # A step whose workers send nothing leaves them to the next step that does.
        side.client.flush(self.config.store_wait_s if plan else 0.0)
        return KVTBConnectorMetadata(plan)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Failed loads (their chunks are stored again once recomputed) and, with KV events,
        the workers' store reports."""
        assert self.scheduler_side is not None
        self.scheduler_side.load_failed(connector_output.invalid_block_ids)
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, vllm_telemetry.KVTBWorkerMetadata):
            for reader in (self.announcer, self.scheduler_side.client.mirror):
                if reader is not None:  # KV events, the lookup mirror
                    reader.reported(meta.reports)

    def take_events(self) -> list[KVCacheEvent]:
        """Chunks stored in and removed from the cache server since the last call, as vLLM KV
        events (medium ``kvtb`` for its L1, ``kvtb/disk`` etc. for its lower tiers) for vLLM's
        publisher. vLLM calls it once at the end of each
        ``update_from_output``: the step's ends of sessions are sent then (one frame)."""
        if self.scheduler_side is not None:
            self.scheduler_side.client.flush()
        if self.announcer is None:
            return []
        assert self.scheduler_side is not None
        return vllm_telemetry.announced(self.announcer, self.scheduler_side.client)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler_side is not None
        delayed = self.scheduler_side.request_finished(
            request.request_id, failed=request.status == RequestStatus.FINISHED_ERROR
        )
        if request.status == RequestStatus.FINISHED_ABORTED:  # outside a step: no flush follows
            self.scheduler_side.client.flush()
        if not delayed:
            self._requests.pop(request.request_id, None)
        return delayed, None
