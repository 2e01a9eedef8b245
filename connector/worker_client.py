"""Worker-side client: registers the KV caches, stores and retrieves batches of chunks.

Runs in each worker process (one per TP rank). :class:`WorkerClient` is the one object the
connector and the engines hold; it delegates to the owners of each job:

- :mod:`connector.worker_registration`: identity, the pool mapping, registering again when
  the server restarted, aborts of operations given up on;
- :mod:`connector.worker_stores`: a store is short: reserve slots (one round trip), copy the
  blocks into the shared pool, commit;
- :mod:`connector.worker_retrieves`: a retrieve is asynchronous: :meth:`submit_retrieves`
  sends the request and returns; the copy and the release happen in
  :meth:`complete_retrieves`, which reports the finished requests and the blocks that could
  not be loaded (chunks evicted or expired since the lookup, a dead server, an unconfirmed
  release) so the engine recomputes them;
- :mod:`connector.worker_spans`: every batch's span (one CLIENT span parented on its first
  request's context, linked to all of them, one ``kvcache.item`` event per request).

The rank and fan-out rules (:class:`~testbed.core.ranks.WorkerIdentity`) are the core's.
"""

from __future__ import annotations

from collections.abc import Iterable

from connector.cuda_ipc import CudaExport
from connector.faults import FaultInjector
from connector.kv_copy import PagedKV
from connector.kv_events import ChunkReport
from connector.ops import RetrieveOp, StoreOp
from connector.shared_kv import SharedKV
from connector.stats import StatsRecorder
from connector.worker_registration import Registration
from connector.worker_retrieves import RetrieveOutcome, Retrieves
from connector.worker_stores import Stores
from testbed.core.ranks import WorkerIdentity
from testbed.core.rpc import RpcClient

__all__ = ["RetrieveOutcome", "WorkerClient"]


class WorkerClient:
    """One worker's client of the cache server: registration, stores, retrieves."""

    def __init__(
        self, rpc: RpcClient, identity: WorkerIdentity, faults: FaultInjector | None = None
    ) -> None:
        self.rpc = rpc
        self.identity = identity
        self.faults = faults if identity.tp_rank == 0 else None
        self.stats = StatsRecorder()
        """Stores and retrieves for vLLM's connector stats."""
        self.registration = Registration(rpc, identity, self.stats)
        self.stores = Stores(self.registration, self.stats)
        self.retrieves = Retrieves(self.registration, self.stats, self.faults)

    # -----------------------------------------------------------------------------------------
    # Registration
    # -----------------------------------------------------------------------------------------

    def register(self, kv: PagedKV) -> None:
        """Announces the layout and maps the server's pool (unmapping another instance's);
        raises if the server refuses or is down. Server-driven, the KV tensors first move
        (in place: vLLM keeps using them) into a shared file the server maps."""
        self.registration.register(kv)

    @property
    def kv(self) -> PagedKV | None:
        """The registered KV (set without registering when the server was down: the first
        store or retrieve registers it)."""
        return self.registration.kv

    @kv.setter
    def kv(self, kv: PagedKV | None) -> None:
        self.registration.kv = kv

    @property
    def epoch(self) -> int:
        """The server instance this worker registered with (and whose pool it maps)."""
        return self.registration.epoch

    @property
    def blocks_per_chunk(self) -> int:
        return self.registration.blocks_per_chunk

    @property
    def shared(self) -> SharedKV | CudaExport | None:
        """Server-driven transfers: the KV tensors moved into a file the server maps, or
        exported through CUDA IPC."""
        return self.registration.shared

    # -----------------------------------------------------------------------------------------
    # Store
    # -----------------------------------------------------------------------------------------

    def store(self, ops: list[StoreOp], wait_s: float | None = None) -> bool:
        """Stores the chunks of ``ops`` and waits for the commit (tests and tools; engines use
        :meth:`submit_stores` and :meth:`progress_stores`); False if not (fully) stored."""
        return self.stores.store(ops, wait_s)

    def submit_stores(self, ops: list[StoreOp]) -> None:
        """Starts storing ``ops`` and returns at once: the forward pass never waits on the
        network. :meth:`progress_stores` moves the store on (copy, commit) as replies come."""
        self.stores.submit(ops)

    def progress_stores(self, wait_s: float = 0.0) -> None:
        """Moves every store on as far as its replies allow, waiting up to ``wait_s`` in all."""
        self.stores.progress(wait_s)

    def cancel_stores(self, request_ids: Iterable[str]) -> None:
        """The engine preempted these requests: stores whose copy has not happened yet are
        abandoned (server-driven: once the server's copies of them are done)."""
        self.stores.cancel(request_ids)

    @property
    def pending_store_requests(self) -> set[str]:
        """Requests with a store of this worker still in flight."""
        return self.stores.pending_requests

    @property
    def stores_failed(self) -> int:
        """Stores (batches) that did not commit, since the client started."""
        return self.stores.failed

    @property
    def report_chunks(self) -> bool:
        """Whether finished stores report their chunks (vLLM's KV events)."""
        return self.stores.report_chunks

    @report_chunks.setter
    def report_chunks(self, report: bool) -> None:
        self.stores.report_chunks = report

    def take_chunk_reports(self) -> list[ChunkReport]:
        """The chunks of the stores finished since the last call (see :attr:`report_chunks`)."""
        return self.stores.take_chunk_reports()

    # -----------------------------------------------------------------------------------------
    # Retrieve
    # -----------------------------------------------------------------------------------------

    def submit_retrieves(self, ops: list[RetrieveOp]) -> None:
        """Starts retrieving ``ops``; :meth:`complete_retrieves` finishes them."""
        self.retrieves.submit(ops)

    def complete_retrieves(
        self, wait_s: float = 0.0, *, fail_outstanding: bool = False
    ) -> RetrieveOutcome:
        """Finishes the retrieves whose plan has arrived (waiting up to ``wait_s`` for all);
        with ``fail_outstanding``, fails those still unanswered (see
        :meth:`connector.worker_retrieves.Retrieves.complete`)."""
        return self.retrieves.complete(wait_s, fail_outstanding=fail_outstanding)

    @property
    def num_inflight_retrieves(self) -> int:
        return len(self.retrieves.inflight)

    # -----------------------------------------------------------------------------------------
    # Lifecycle
    # -----------------------------------------------------------------------------------------

    def close(self) -> None:
        """Finishes the stores in flight (up to the timeout), abandons in-flight retrieves
        (aborted on the server) and leaves the server."""
        self.stores.close()
        self.retrieves.close()
        self.registration.close()
        if self.faults is not None:
            self.faults.close()
