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

from connector import tracing
from connector.config import ConnectorConfig
from connector.faults import FaultInjector
from connector.kv_copy import PagedKV
from connector.ops import FinishingOrder, StepPlan
from connector.planner import Geometry
from connector.scheduler import RequestView, ScheduledRequest, SchedulerSide
from connector.scheduler_client import SchedulerClient
from connector.worker_client import (
    WorkerClient,
    WorkerIdentity,
    kv_world_size,
    readers_per_object,
)
from testbed import protocol as p
from testbed.credentials import client_token
from testbed.rpc import CurveKeys, RemoteError, RpcClient, ServerUnavailable
from testbed.telemetry import attributes as a

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


class KVTBConnectorMetadata(KVConnectorMetadata):
    """The step's plan, from the scheduler side to every worker."""

    def __init__(self, plan: StepPlan) -> None:
        super().__init__()
        self.plan = plan


class KVTBConnector(KVConnectorBase_V1):
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        self.config = ConnectorConfig.from_extra_config(transfer.kv_connector_extra_config)
        self.block_size = vllm_config.cache_config.block_size
        parallel = vllm_config.parallel_config
        tp_size = parallel.tensor_parallel_size
        tp_rank = parallel.rank % tp_size
        mla = self.config.mla if self.config.mla is not None else vllm_config.model_config.use_mla
        model = self.config.model_name or vllm_config.model_config.model
        side = "scheduler" if role == KVConnectorRole.SCHEDULER else f"worker{tp_rank}"
        config = self.config
        self._traces = tracing.acquire(
            config.span_dir,
            run_id=config.run_id,
            service_name="kvtb-connector",
            rank=None if role == KVConnectorRole.SCHEDULER else tp_rank,
            resource={
                a.TP_SIZE: tp_size,
                a.MLA: bool(mla),
                a.MODEL: str(model),
            },
        )
        curve = None
        if config.curve_secret_key:
            curve = CurveKeys(Path(config.curve_secret_key), Path(config.curve_server_key))
        self.rpc = RpcClient(
            config.server_url,
            role=side,
            token=client_token(config.token, config.token_file or None),
            timeout_s=config.mq_timeout_s,
            heartbeat_interval_s=config.heartbeat_interval_s,
            curve=curve,
        )
        chunk_size = self._server_chunk_size()
        self.scheduler_side: SchedulerSide | None = None
        self.worker: WorkerClient | None = None
        self._load_errors: set[int] = set()
        if role == KVConnectorRole.SCHEDULER:
            client = SchedulerClient(
                self.rpc,
                model=model,
                world_size=kv_world_size(tp_size, mla),
                num_readers=readers_per_object(tp_size, mla),
                chunk_size=chunk_size,
            )
            self.scheduler_side = SchedulerSide(
                client,
                Geometry(chunk_size, self.block_size),
                engine_id=self.config.engine_id or transfer.engine_id or "engine",
                default_cache_salt=self.config.cache_salt,
                load_async=self.config.load_async,
                lookup_wait_s=self.config.lookup_wait_s,
                # Stores on their own timing: a pending answer may wait on this engine's own
                # worker, which runs after the scheduler; vLLM asks again next step.
                wait_pending=self.config.store_wait_s > 0,
                store_decode_tokens=self.config.store_decode_tokens,
                tp_size=tp_size,
            )
        else:
            Geometry(chunk_size, self.block_size)  # validates the block size early
            faults = None
            if config.fault_drop_fraction:
                admin = RpcClient(
                    config.server_url,
                    role=f"faults{tp_rank}",
                    token=config.admin_token,
                    timeout_s=config.mq_timeout_s,
                    curve=curve,
                )
                faults = FaultInjector(admin, config.fault_drop_fraction, config.fault_seed)
            identity = WorkerIdentity.for_rank(
                model, tp_size, tp_rank, mla, transfer_mode=config.transfer_mode
            )
            self.worker = WorkerClient(self.rpc, identity, faults)
            # Finished requests whose blocks vLLM keeps for our stores, in finishing order: vLLM
            # frees them in the order it reads finished_sending, and that order decides which
            # blocks its own prefix cache evicts first (runs must not depend on set order).
            self._delayed: dict[str, None] = {}

    def _server_chunk_size(self) -> int:
        try:
            info = self.rpc.call(p.GetConfig())
        except (ServerUnavailable, RemoteError) as exc:
            log.warning(
                "cache server at %s not reachable (%s); assuming chunk size %d, misses until it is",
                self.config.server_url,
                exc,
                self.config.chunk_size,
            )
            return self.config.chunk_size
        assert isinstance(info, p.ServerConfigInfo)
        return info.chunk_size

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

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.scheduler_side is not None:
            self.scheduler_side.close()
        self.rpc.close()
        if self._traces:
            self._traces = False
            tracing.release()

    def _plan(self) -> StepPlan:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KVTBConnectorMetadata)
        return metadata.plan

    # -----------------------------------------------------------------------------------------
    # Scheduler side
    # -----------------------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self.scheduler_side is not None
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

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler_side is not None
        plan = self.scheduler_side.build_plan(
            scheduled_requests(scheduler_output), scheduler_output.preempted_req_ids or ()
        )
        return KVTBConnectorMetadata(plan)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler_side is not None
        return self.scheduler_side.request_finished(request.request_id), None


# ---------------------------------------------------------------------------------------------
# Conversions from vLLM's objects
# ---------------------------------------------------------------------------------------------


def request_view(request: Request) -> RequestView:
    headers = request.trace_headers or {}
    return RequestView(
        request_id=request.request_id,
        token_ids=request.all_token_ids,
        num_prompt_tokens=request.num_prompt_tokens,
        num_tokens=request.num_tokens,
        cache_salt=request.cache_salt or "",
        traceparent=headers.get("traceparent", ""),
    )


def scheduled_requests(output: SchedulerOutput) -> list[ScheduledRequest]:
    steps = [
        ScheduledRequest(
            request_id=new.req_id,
            num_computed_tokens=new.num_computed_tokens,
            num_scheduled_tokens=output.num_scheduled_tokens[new.req_id],
            block_ids=single_group(new.block_ids),
            all_blocks=True,
        )
        for new in output.scheduled_new_reqs
    ]
    cached = output.scheduled_cached_reqs
    for index, request_id in enumerate(cached.req_ids):
        new_blocks = cached.new_block_ids[index]
        steps.append(
            ScheduledRequest(
                request_id=request_id,
                num_computed_tokens=cached.num_computed_tokens[index],
                num_scheduled_tokens=output.num_scheduled_tokens[request_id],
                block_ids=single_group(new_blocks) if new_blocks is not None else [],
                all_blocks=request_id in cached.resumed_req_ids,
            )
        )
    return steps


def single_group(block_ids: tuple[list[int], ...] | list[list[int]]) -> list[int]:
    if len(block_ids) != 1:
        raise RuntimeError(
            "KVTBConnector supports one KV cache group; start vLLM with "
            "--disable-hybrid-kv-cache-manager"
        )
    return list(block_ids[0])


def block_dim_of(layer: torch.Tensor, num_blocks: int | None) -> int:
    """The dimension of a paged KV tensor that indexes blocks."""
    if num_blocks is not None:
        matches = [dim for dim, size in enumerate(layer.shape) if size == num_blocks]
        if len(matches) == 1:
            return matches[0]
        if matches:
            # (num_blocks, 2, ...) or (2, num_blocks, ...): vLLM puts blocks in front of or
            # right after the K/V split.
            return matches[0] if layer.shape[0] != 2 else 1
    raise ValueError(
        f"cannot tell which dimension of the KV cache of shape {tuple(layer.shape)} holds the "
        f"{num_blocks} blocks"
    )
