"""Worker-side client: registers the KV caches, stores and retrieves batches of chunks.

Runs in each worker process (one per TP rank). A store is short: reserve slots (one round
trip), copy the blocks into the shared pool, commit. A retrieve is asynchronous:
:meth:`WorkerClient.submit_retrieves` sends the request and returns; the copy and the release
happen in :meth:`WorkerClient.complete_retrieves`, which reports the finished requests and the
blocks that could not be loaded (chunks evicted or expired since the lookup, a dead server,
an unconfirmed release) so the engine recomputes them.

Trust rules:

- the pool mapping always belongs to the server instance (epoch) the worker registered with:
  a reply of another epoch means the server restarted, and the worker registers again and maps
  the new pool before any copy; operations name their epoch, so the server refuses stale ones;
- a load counts only when the server confirmed its release (``RetrieveDone``): that proves the
  pins held during the copy; otherwise its blocks are reported failed;
- an operation the worker gave up on (timeout, copy error) is aborted on the server by its
  ``op_id`` (a ``kvcache.connector.abort`` span), so no reservation or pin outlives the
  worker's interest.

Every batch leaves one CLIENT span parented on its first request's context, linked to all of
them, with one ``kvcache.item`` event per request (range, attempt, and for a failed load the
first token of the first failed block).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from connector.cuda_ipc import CudaExport, DoneEvent
from connector.faults import FaultInjector
from connector.kv_copy import PagedKV, PoolMapping
from connector.kv_events import ChunkReport, store_reports
from connector.ops import RetrieveOp, StoreOp
from connector.shared_kv import SharedKV
from connector.stats import StatsRecorder
from testbed.core import protocol as p
from testbed.core import telemetry
from testbed.core.block_copy import ChunkCopy, item_copies
from testbed.core.ranks import WorkerIdentity, resolve_transfer_mode
from testbed.core.rpc import RemoteError, RpcClient, ServerUnavailable, reply_timing
from testbed.core.telemetry import SpanKind
from testbed.core.telemetry import attributes as a

log = logging.getLogger(__name__)

_REGISTER_AGAIN = ("not_registered", "stale_epoch")


@dataclass
class _Retrieve:
    ops: list[RetrieveOp]
    op_id: int
    epoch: int
    future: Future[p.Reply] | None
    span: telemetry.Span
    started_at: float
    started_ns: int
    """The span's start (wall clock, ns): its duration is exactly what the stats record."""
    ready_token: int | None = None
    """CUDA IPC: the ready event lent to this retrieve (back to the ring when it ends)."""
    device_done: DoneEvent | None = None
    """CUDA IPC: the server's done event, once the plan named it."""


@dataclass
class _Store:
    ops: list[StoreOp]
    op_id: int
    epoch: int
    span: telemetry.Span
    started_ns: int
    future: Future[p.Reply] | None = None
    stage: str = "begin"
    """begin (waiting for the plan), then commit (waiting for the commit's answer)."""
    plan: p.StorePlan | None = None
    failure: str | None = None
    cancelled: bool = False
    retried: bool = False
    copy_ms: float = 0.0
    ready_token: int | None = None
    """CUDA IPC: the ready event lent to this store (back to the ring when it ends)."""
    device_done: DoneEvent | None = None
    """CUDA IPC: the server's done event; the store commits once it has completed."""
    server_s: float = 0.0
    """Seconds between sending a request and its reply arriving (both round trips)."""
    poll_wait_s: float = 0.0
    """Seconds replies waited for the worker's next hook to take them."""
    step_wait_s: float = 0.0
    """Seconds the engine's step was held waiting for this store's replies (0 when stores
    are asynchronous: the forward pass never waits on the network)."""


@dataclass
class RetrieveOutcome:
    finished: set[str] = field(default_factory=set)
    failed_block_ids: set[int] = field(default_factory=set)


class WorkerClient:
    def __init__(
        self, rpc: RpcClient, identity: WorkerIdentity, faults: FaultInjector | None = None
    ) -> None:
        self.rpc = rpc
        self.identity = identity
        self.faults = faults if identity.tp_rank == 0 else None
        self.kv: PagedKV | None = None
        self.chunk_size = 0
        self.epoch = 0
        """The server instance this worker registered with (and whose pool it maps)."""
        self._pool: PoolMapping | None = None
        self._pool_path = ""
        self._inflight: list[_Retrieve] = []
        self._stores: list[_Store] = []
        self.stores_failed = 0
        """Stores (batches) that did not commit, since the client started."""
        self.shared: SharedKV | CudaExport | None = None
        """Server-driven transfers: the KV tensors moved into a file the server maps, or
        exported through CUDA IPC."""
        self.transfer_mode = identity.transfer_mode
        """The mode in use: ``identity.transfer_mode`` with ``auto`` resolved at registration."""
        self.stats = StatsRecorder()
        """Stores and retrieves for vLLM's connector stats."""
        self.report_chunks = False
        """Collect a :class:`ChunkReport` per chunk of every finished store (vLLM's KV events:
        the scheduler announces the chunks every writing rank stored)."""
        self._chunk_reports: list[ChunkReport] = []

    # -----------------------------------------------------------------------------------------
    # Registration
    # -----------------------------------------------------------------------------------------

    def register(self, kv: PagedKV) -> None:
        """Announces the layout and maps the server's pool (unmapping another instance's);
        raises if the server refuses or is down. Server-driven, the KV tensors first move
        (in place: vLLM keeps using them) into a shared file the server maps."""
        device_type = kv.layers[0].device.type
        self.transfer_mode = resolve_transfer_mode(self.identity.transfer_mode, device_type)
        if self.transfer_mode == "server" and self.shared is None:
            if device_type == "cuda":
                self.shared = CudaExport(kv)
            else:
                self.shared = SharedKV(kv.layers, kv.block_dim, kv.block_size)
                kv = PagedKV(kv.layers, kv.block_dim, kv.block_size)
        self.kv = kv
        ident = self.identity
        with telemetry.traced(
            a.CONNECTOR_REGISTER,
            kind=SpanKind.CLIENT,
            attributes={a.KV_RANK: ident.kv_rank, a.RANK: ident.tp_rank, a.MODEL: ident.model},
        ) as span:
            traceparent, tracestate = telemetry.inject()
            reply = self.rpc.call(
                p.RegisterWorker(
                    model=ident.model,
                    world_size=ident.world_size,
                    kv_rank=ident.kv_rank,
                    tp_size=ident.tp_size,
                    mla=ident.mla,
                    layout=kv.layout(),
                    shared_kv=self.shared.description
                    if isinstance(self.shared, SharedKV)
                    else None,
                    cuda_kv=self.shared.description
                    if isinstance(self.shared, CudaExport)
                    else None,
                    traceparent=traceparent,
                    tracestate=tracestate,
                )
            )
            assert isinstance(reply, p.WorkerRegistered)
            remapped = self._map_pool(reply)
            self.chunk_size = reply.chunk_size
            self.epoch = reply.epoch
            span.set_attributes(
                {
                    a.EPOCH: reply.epoch,
                    a.REASON: "remap" if remapped else "map",
                    a.BYTES_PER_TOKEN: kv.bytes_per_token,
                    a.WORLD_SIZE: ident.world_size,
                    a.OBJECT_BYTES: reply.object_bytes,
                    a.TRANSFER_MODE: self.transfer_mode,
                }
            )

    def _map_pool(self, reply: p.WorkerRegistered) -> bool:
        """Maps the reply's pool unless it is the one mapped; True if a mapping was replaced."""
        if (
            self._pool is not None
            and reply.pool_path == self._pool_path
            and reply.epoch == self.epoch
        ):
            return False
        replaced = self._pool is not None
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        self._pool_path = reply.pool_path
        if reply.pool_path:
            self._pool = PoolMapping(reply.pool_path, reply.pool_bytes)
        if replaced:
            log.warning("the cache server restarted (epoch %d); mapped its new pool", reply.epoch)
        return replaced

    def _ensure_current(self) -> None:
        """Registers again when the server's epoch changed since registration."""
        if self.kv is not None and self.rpc.server_epoch not in (0, self.epoch):
            self.register(self.kv)

    @property
    def blocks_per_chunk(self) -> int:
        assert self.kv is not None
        return self.chunk_size // self.kv.block_size

    # -----------------------------------------------------------------------------------------
    # Store
    # -----------------------------------------------------------------------------------------

    def store(self, ops: list[StoreOp], wait_s: float | None = None) -> bool:
        """Stores the chunks of ``ops`` and waits for the commit (tests and tools; engines use
        :meth:`submit_stores` and :meth:`progress_stores`); False if not (fully) stored."""
        if not ops or not self.identity.writer:
            return True
        before = self.stores_failed
        self.submit_stores(ops)
        self.progress_stores(self.rpc.timeout_s * 2 if wait_s is None else wait_s)
        return self.stores_failed == before and not self._stores

    def submit_stores(self, ops: list[StoreOp]) -> None:
        """Starts storing ``ops`` and returns at once: the forward pass never waits on the
        network. :meth:`progress_stores` moves the store on (copy, commit) as replies come."""
        if not ops or not self.identity.writer:
            return
        assert self.kv is not None, "register() first"
        started_ns = time.time_ns()
        span = telemetry.start_span(
            a.CONNECTOR_STORE,
            kind=SpanKind.CLIENT,
            parent=ops[0].traceparent,
            links=[op.traceparent for op in ops],
            attributes=self._batch_attributes(ops),
            start_time_ns=started_ns,
        )
        op_id = self.rpc.new_op_id()
        store = _Store(ops, op_id, self.epoch, span, started_ns)
        span.set_attribute(a.OP_ID, op_id)
        if not self.rpc.alive:
            self._end_store(store, "cache server unavailable; not storing")
            return
        with contextlib.suppress(ServerUnavailable, RemoteError):
            self._ensure_current()
        store.epoch = self.epoch
        store.ready_token, ready = self._record_ready()
        traceparent = telemetry.traceparent_of(span) or ops[0].traceparent
        begin = p.StoreBegin(
            op_id=op_id,
            epoch=self.epoch,
            items=self._items(ops),
            traceparent=traceparent,
            ready_event=ready,
        )
        store.future = self.rpc.submit(begin)
        self._stores.append(store)

    def progress_stores(self, wait_s: float = 0.0) -> None:
        """Moves every store on as far as its replies allow, waiting up to ``wait_s`` in all:
        a plan arrived → copy (worker-driven; CUDA IPC: the server's copies completed) →
        commit; a commit arrived → done."""
        deadline = time.monotonic() + wait_s
        still: list[_Store] = []
        for store in self._stores:
            while store.future is not None or store.device_done is not None:
                if store.device_done is not None:
                    if not _device_done(store.device_done, deadline):
                        break
                    store.device_done = None
                    self._submit_commit(store)
                    continue
                assert store.future is not None
                remaining = deadline - time.monotonic()
                if not store.future.done() and remaining > 0:
                    blocked_at = time.monotonic()
                    with contextlib.suppress(Exception):
                        store.future.result(remaining)
                    store.step_wait_s += time.monotonic() - blocked_at
                if not store.future.done():
                    break
                self._advance(store)
            if store.future is not None or store.device_done is not None:
                still.append(store)
        self._stores = still

    def cancel_stores(self, request_ids: Iterable[str]) -> None:
        """The engine preempted these requests: their blocks may be reused, so stores whose
        copy has not happened yet are abandoned (aborted when their plan comes). Server-driven,
        the server copies while it plans, so this waits for those plans first."""
        cancelled = set(request_ids)
        if not cancelled:
            return
        for store in self._stores:
            if store.stage == "begin" and any(op.request_id in cancelled for op in store.ops):
                store.cancelled = True
                if self.shared is not None and store.future is not None:
                    # The server copies while it plans: its reply must be in before the next
                    # forward pass may write into the blocks (bounded by the RPC timeout).
                    blocked_at = time.monotonic()
                    with contextlib.suppress(Exception):
                        store.future.result(self.rpc.timeout_s)
                    store.step_wait_s += time.monotonic() - blocked_at
                    self._order_after(store.future)

    @property
    def pending_store_requests(self) -> set[str]:
        """Requests with a store of this worker still in flight."""
        return {op.request_id for store in self._stores for op in store.ops}

    def _advance(self, store: _Store) -> None:
        """One reply of ``store`` arrived: take the next step."""
        assert store.future is not None
        reply = _reply_or_error(store.future, store)
        answered = store.future.exception(0) is None
        store.future = None
        if isinstance(reply, str):
            if store.stage == "begin":
                if not answered:  # no plan came back: the server may still hold the op
                    self._abort(store.op_id, store.span, reply)
                # A server that restarted before this worker heard of it answers (or fails)
                # that the worker is not registered: register once more, anew, and retry.
                if any(code in reply for code in _REGISTER_AGAIN) and not store.retried:
                    with contextlib.suppress(ServerUnavailable, RemoteError):
                        assert self.kv is not None
                        self.register(self.kv)  # the server restarted: once more, anew
                        store.retried = True
                        store.op_id = self.rpc.new_op_id()
                        store.epoch = self.epoch
                        self._release_ready(store.ready_token)
                        store.ready_token, ready = self._record_ready()
                        store.future = self.rpc.submit(
                            p.StoreBegin(
                                op_id=store.op_id,
                                epoch=self.epoch,
                                items=self._items(store.ops),
                                traceparent=telemetry.traceparent_of(store.span),
                                ready_event=ready,
                            )
                        )
                        return
            self._end_store(store, f"store not committed: {reply}")
            return
        if store.stage == "begin":
            assert isinstance(reply, p.StorePlan)
            store.plan = reply
            if store.cancelled:
                store.failure = "the request was preempted before its blocks were copied"
            elif reply.epoch != store.epoch or self._stale():
                store.failure = "the server restarted during the store"
            elif reply.done_event is not None and isinstance(self.shared, CudaExport):
                # CUDA IPC: commit once the server's copies have completed on its stream.
                store.device_done = self.shared.events.opened(reply.done_event)
                return
            elif not reply.copied:
                started = time.perf_counter()
                if not self._copy_in(store.ops, reply):
                    store.failure = "copying KV into the pool failed"
                store.copy_ms = (time.perf_counter() - started) * 1e3
            self._submit_commit(store)
            return
        assert isinstance(reply, p.StoreDone)
        self._end_store(store, store.failure, reply.num_committed, reply.eviction_seq)

    def _submit_commit(self, store: _Store) -> None:
        commit = p.StoreCommit(
            op_id=store.op_id,
            ok=store.failure is None,
            traceparent=telemetry.traceparent_of(store.span),
        )
        store.stage = "commit"
        store.future = self.rpc.submit(commit)

    def _record_ready(self) -> tuple[int | None, p.CudaEvent | None]:
        """CUDA IPC: an event recorded now on the KV's stream, lent to one operation."""
        if not isinstance(self.shared, CudaExport):
            return None, None
        return self.shared.events.record()

    def _release_ready(self, token: int | None) -> None:
        if isinstance(self.shared, CudaExport):
            self.shared.events.release(token)

    def _order_after(self, future: Future[p.Reply]) -> None:
        """CUDA IPC: later work on the KV's stream waits for the copies of a plan that has
        arrived (a preempted request's blocks are read before they are reused)."""
        if not isinstance(self.shared, CudaExport) or not future.done():
            return
        with contextlib.suppress(Exception):
            reply = future.result(0)
            if isinstance(reply, p.StorePlan) and reply.done_event is not None:
                self.shared.events.opened(reply.done_event).order_stream(self.shared.events.device)

    def _end_store(
        self, store: _Store, failure: str | None, committed: int = 0, eviction_seq: int = 0
    ) -> None:
        self._release_ready(store.ready_token)
        span = store.span
        ok = failure is None
        plan = store.plan
        nbytes = _slot_bytes(plan.items) if ok and plan is not None else 0
        self._store_items(span, store.ops, plan, committed=ok)
        span.set_attributes(
            {
                a.OK: ok,
                a.CHUNKS_WRITTEN: committed,
                a.BYTES: nbytes,
                a.COPY_MS: store.copy_ms,
                a.SERVER_MS: store.server_s * 1e3,
                a.POLL_WAIT_MS: store.poll_wait_s * 1e3,
                a.STEP_WAIT_MS: store.step_wait_s * 1e3,
                a.SERVER_COPIED: bool(plan is not None and plan.copied),
            }
        )
        if plan is not None:
            span.set_attributes(
                {
                    a.CHUNKS_PRESENT: sum(item.num_present for item in plan.items),
                    a.CHUNKS_FULL: sum(item.num_full for item in plan.items),
                }
            )
        if not ok:
            self.stores_failed += 1
            _give_up(span, failure or "store failed")
        if self.report_chunks:
            slots = None if not ok or plan is None else [item.slots for item in plan.items]
            reports = store_reports(self.identity.kv_rank, store.ops, slots, eviction_seq)
            self._chunk_reports += reports
        ended_ns = time.time_ns()
        span.end(end_time=ended_ns)
        self.stats.store(nbytes=nbytes, ok=ok, seconds=(ended_ns - store.started_ns) / 1e9)

    def take_chunk_reports(self) -> list[ChunkReport]:
        """The chunks of the stores finished since the last call (see :attr:`report_chunks`)."""
        reports, self._chunk_reports = self._chunk_reports, []
        return reports

    def _store_items(
        self,
        span: telemetry.Span,
        ops: list[StoreOp],
        plan: p.StorePlan | None,
        *,
        committed: bool,
    ) -> None:
        for index, op in enumerate(ops):
            item = plan.items[index] if plan is not None else None
            attributes = {**_op_attributes(op), a.OK: committed}
            if item is not None:
                attributes.update(
                    {
                        a.CHUNKS_WRITTEN: sum(slot is not None for slot in item.slots),
                        a.CHUNKS_PRESENT: item.num_present,
                        a.CHUNKS_FULL: item.num_full,
                        a.BYTES: _slot_bytes([item]) if committed else 0,
                    }
                )
            span.add_event(a.ITEM_EVENT, attributes)

    def _copy_in(self, ops: list[StoreOp], plan: p.StorePlan) -> bool:
        if self._pool is None:
            return True  # metadata-only server: nothing to copy
        assert self.kv is not None
        copies = [
            copy
            for op, item in zip(ops, plan.items, strict=True)
            for copy in item_copies(op.block_ids, item.slots, self.blocks_per_chunk)[0]
        ]
        try:
            if copies:
                self.kv.store_chunks(self._pool.array, copies)
        except (RuntimeError, ValueError, IndexError):
            log.exception("copying KV into the pool failed; aborting the store")
            return False
        return True

    def _items(self, ops: list[StoreOp] | list[RetrieveOp]) -> list[p.OpItem]:
        """The ops as protocol items; server-driven, with the blocks the server copies."""
        assert self.kv is not None
        with_blocks = self.shared is not None
        return [
            p.OpItem(
                session_id=op.session_id,
                cache_salt=op.cache_salt,
                chunk_hashes=op.chunk_hashes,
                first_chunk=op.first_chunk,
                handle=op.handle,
                traceparent=op.traceparent,
                block_ids=op.block_ids if with_blocks else [],
                skip_blocks=op.skip_first_n_tokens // self.kv.block_size
                if with_blocks and isinstance(op, RetrieveOp)
                else 0,
            )
            for op in ops
        ]

    def _abort(self, op_id: int, op_span: telemetry.Span, reason: str) -> None:
        """Tells the server to drop an operation this worker gave up on (fire and forget),
        leaving a ``kvcache.connector.abort`` span under the operation's.

        Sent even when the server looks down: one that was only frozen or slow reads it when
        it resumes, after the request it aborts (one connection keeps their order), so its
        pins or reservation go at once; for one that is gone, its operation deadline cleans up.
        """
        self.stats.abandoned_release()
        with telemetry.traced(
            a.CONNECTOR_ABORT,
            kind=SpanKind.CLIENT,
            parent=telemetry.traceparent_of(op_span),
            attributes={a.OP_ID: op_id, a.ABANDONED: True, a.REASON: reason[:500]},
        ):
            traceparent, tracestate = telemetry.inject()
            with contextlib.suppress(ServerUnavailable):
                self.rpc.fire(
                    p.Abort(op_ids=[op_id], traceparent=traceparent, tracestate=tracestate)
                )

    # -----------------------------------------------------------------------------------------
    # Retrieve
    # -----------------------------------------------------------------------------------------

    def submit_retrieves(self, ops: list[RetrieveOp]) -> None:
        """Starts retrieving ``ops``; :meth:`complete_retrieves` finishes them."""
        if not ops:
            return
        started_ns = time.time_ns()
        span = telemetry.start_span(
            a.CONNECTOR_RETRIEVE,
            kind=SpanKind.CLIENT,
            parent=ops[0].traceparent,
            links=[op.traceparent for op in ops],
            attributes=self._batch_attributes(ops),
            start_time_ns=started_ns,
        )
        op_id = self.rpc.new_op_id()
        future = None
        if self.faults is not None:
            self.faults.before_retrieve(ops)
        token = None
        if self.rpc.alive:
            with contextlib.suppress(ServerUnavailable, RemoteError):
                self._ensure_current()
            token, ready = self._record_ready()
            request = p.RetrieveBegin(
                op_id=op_id,
                epoch=self.epoch,
                items=self._items(ops),
                traceparent=telemetry.traceparent_of(span) or ops[0].traceparent,
                ready_event=ready,
            )
            future = self.rpc.submit(request)
        span.set_attribute(a.OP_ID, op_id)
        self._inflight.append(
            _Retrieve(ops, op_id, self.epoch, future, span, time.monotonic(), started_ns, token)
        )

    @property
    def num_inflight_retrieves(self) -> int:
        return len(self._inflight)

    def complete_retrieves(
        self, wait_s: float = 0.0, *, fail_outstanding: bool = False
    ) -> RetrieveOutcome:
        """Finishes the retrieves whose plan has arrived (waiting up to ``wait_s`` for all);
        with CUDA IPC, once the server's copies have completed too (polled, never waited for
        unless ``fail_outstanding``).

        Every finished request is reported, including those whose load failed; the failed
        chunks' blocks (minus the skipped ones) are in ``failed_block_ids``. With
        ``fail_outstanding`` (synchronous loads: the forward pass is next), retrieves still
        unanswered after the wait are failed too, reported now and aborted on the server.
        """
        outcome = RetrieveOutcome()
        deadline = time.monotonic() + wait_s
        still: list[_Retrieve] = []
        for retrieve in self._inflight:
            remaining = deadline - time.monotonic()
            if retrieve.future is not None and not retrieve.future.done() and remaining > 0:
                with contextlib.suppress(Exception):  # a failed future is handled below
                    retrieve.future.result(remaining)
            if retrieve.future is not None and not retrieve.future.done():
                if not fail_outstanding:
                    still.append(retrieve)
                    continue
                retrieve.future.cancel()
                reason = "no answer before the forward pass"
                self._abort(retrieve.op_id, retrieve.span, reason)
                self._fail_all(retrieve, outcome, reason)
                continue
            if not self._copies_done(retrieve, deadline, fail_outstanding):
                still.append(retrieve)
                continue
            self._finish(retrieve, outcome)
        self._inflight = still
        return outcome

    def _copies_done(self, retrieve: _Retrieve, deadline: float, wait: bool) -> bool:
        """CUDA IPC: whether the server's copies of an answered retrieve have completed
        (``wait``: blocks until they have); True for every other retrieve."""
        if retrieve.device_done is None and isinstance(self.shared, CudaExport):
            plan = _plan_or_error(retrieve.future)
            if isinstance(plan, p.RetrievePlan) and plan.done_event is not None:
                retrieve.device_done = self.shared.events.opened(plan.done_event)
        if retrieve.device_done is None:
            return True
        if wait:
            retrieve.device_done.wait()
            return True
        return _device_done(retrieve.device_done, deadline)

    def _fail_all(self, retrieve: _Retrieve, outcome: RetrieveOutcome, reason: str) -> None:
        self._release_ready(retrieve.ready_token)
        assert self.kv is not None
        for op in retrieve.ops:
            blocks = self._loadable_blocks(op)
            outcome.failed_block_ids.update(blocks)
            outcome.finished.add(op.request_id)
            retrieve.span.add_event(a.ITEM_EVENT, _failed_item(op, blocks, self.kv.block_size))
        _give_up(retrieve.span, reason)
        self._end_retrieve_span(retrieve, ok=False, nbytes=0)

    def _end_retrieve_span(self, retrieve: _Retrieve, *, ok: bool, nbytes: int) -> None:
        ended_ns = time.time_ns()
        retrieve.span.end(end_time=ended_ns)
        seconds = (ended_ns - retrieve.started_ns) / 1e9
        self.stats.retrieve(nbytes=nbytes, ok=ok, seconds=seconds)

    def _finish(self, retrieve: _Retrieve, outcome: RetrieveOutcome) -> None:
        self._release_ready(retrieve.ready_token)
        retrieve.ready_token = None
        span = retrieve.span
        plan = _plan_or_error(retrieve.future)
        if isinstance(plan, str):
            if retrieve.future is not None and retrieve.future.exception(0) is not None:
                # No answer (a timeout): whatever the server pins for it when it gets to it is
                # unowned by anyone waiting; release it then rather than at its deadline.
                self._abort(retrieve.op_id, span, plan)
            if "not_registered" in plan or "stale_epoch" in plan:
                with contextlib.suppress(ServerUnavailable, RemoteError):
                    assert self.kv is not None
                    self.register(self.kv)
            self._fail_all(retrieve, outcome, plan)
            return
        if plan.epoch != self.epoch or self._stale():
            reason = "the server restarted during the retrieve"
            self._abort(retrieve.op_id, span, reason)
            self._fail_all(retrieve, outcome, reason)
            return
        timing = reply_timing(retrieve.future)
        started = time.perf_counter()
        if plan.copied:  # server-driven: it copied while the objects were pinned
            oks, failed, nbytes = self._missing(retrieve.ops, plan)
            released, confirmed = plan.num_locks_released, True
            copy_ms = 0.0
            if plan.done_event is not None:  # CUDA IPC: the copies completed; now unpin
                released, confirmed, end_s = self._end_retrieve(retrieve, oks)
                timing = (timing[0] + end_s, timing[1])
        else:
            oks, failed, nbytes = self._copy_out(retrieve.ops, plan)
            copy_ms = (time.perf_counter() - started) * 1e3
            released, confirmed, end_s = self._end_retrieve(retrieve, oks)
            timing = (timing[0] + end_s, timing[1])
        assert self.kv is not None
        missing = 0
        for op, blocks in zip(retrieve.ops, failed, strict=True):
            if not confirmed:
                blocks = self._loadable_blocks(op)
            outcome.finished.add(op.request_id)
            outcome.failed_block_ids.update(blocks)
            missing += bool(blocks)
            event = (
                _failed_item(op, blocks, self.kv.block_size)
                if blocks
                else {
                    **_op_attributes(op),
                    a.OK: True,
                }
            )
            span.add_event(a.ITEM_EVENT, event)
        retrieved = nbytes if confirmed else 0
        span.set_attributes(
            {
                a.OK: confirmed and all(oks),
                a.CHUNKS_MISSING: sum(not ok for ok in oks),
                a.BYTES: retrieved,
                a.LOCKS_RELEASED: released,
                a.COPY_MS: copy_ms,
                a.SERVER_MS: timing[0] * 1e3,
                a.POLL_WAIT_MS: timing[1] * 1e3,
                a.SERVER_COPIED: plan.copied,
                a.WAIT_MS: (time.monotonic() - retrieve.started_at) * 1e3,
            }
        )
        if missing:
            telemetry.fail(
                span,
                f"{missing} requests could not load every chunk; their blocks are recomputed"
                if confirmed
                else "the server did not confirm the release; every load is recomputed",
            )
        self._end_retrieve_span(retrieve, ok=confirmed and all(oks), nbytes=retrieved)

    def _end_retrieve(self, retrieve: _Retrieve, oks: list[bool]) -> tuple[int, bool, float]:
        """Releases the pins; (lock units released, whether the server confirmed, seconds)."""
        started = time.monotonic()
        try:
            done = self.rpc.call(
                p.RetrieveEnd(
                    op_id=retrieve.op_id,
                    ok=oks,
                    traceparent=telemetry.traceparent_of(retrieve.span),
                )
            )
        except (ServerUnavailable, RemoteError) as exc:
            log.warning("retrieve end not confirmed; its loads count as failed: %s", exc)
            return 0, False, time.monotonic() - started
        assert isinstance(done, p.RetrieveDone)
        return done.num_locks_released, True, time.monotonic() - started

    def _missing(
        self, ops: list[RetrieveOp], plan: p.RetrievePlan
    ) -> tuple[list[bool], list[list[int]], int]:
        """A server-driven retrieve's outcome: per item ok, the blocks of missing chunks
        (minus skipped ones), and the bytes the server copied."""
        oks: list[bool] = []
        failed: list[list[int]] = []
        nbytes = 0
        for _, copies, missing in self._item_copies(ops, plan):
            nbytes += sum(copy.slot.nbytes for copy in copies)
            oks.append(not missing)
            failed.append(missing)
        return oks, failed, nbytes

    def _item_copies(
        self, ops: list[RetrieveOp], plan: p.RetrievePlan
    ) -> Iterator[tuple[RetrieveOp, list[ChunkCopy], list[int]]]:
        """Per op: its chunk copies from the plan's slots and the blocks of missing chunks
        (both past the op's skipped blocks)."""
        assert self.kv is not None
        for op, item in zip(ops, plan.items, strict=True):
            skip_blocks = op.skip_first_n_tokens // self.kv.block_size
            copies, missing = item_copies(
                op.block_ids, item.slots, self.blocks_per_chunk, skip_blocks
            )
            yield op, copies, missing

    def _stale(self) -> bool:
        return self.rpc.server_epoch not in (0, self.epoch)

    def _copy_out(
        self, ops: list[RetrieveOp], plan: p.RetrievePlan
    ) -> tuple[list[bool], list[list[int]], int]:
        """Copies what is present; per item: ok, the blocks that failed, and bytes copied."""
        assert self.kv is not None
        oks: list[bool] = []
        failed: list[list[int]] = []
        nbytes = 0
        for op, copies, item_failed in self._item_copies(ops, plan):
            try:
                nbytes += sum(copy.slot.nbytes for copy in copies)
                if copies and self._pool is not None:  # one batched copy per request
                    self.kv.load_chunks(self._pool.array, copies)
            except (RuntimeError, ValueError, IndexError) as exc:
                log.error("copying KV out of the pool failed for %s: %s", op.request_id, exc)
                item_failed = self._loadable_blocks(op)
            oks.append(not item_failed)
            failed.append(item_failed)
        return oks, failed, nbytes

    def _loadable_blocks(self, op: RetrieveOp) -> list[int]:
        assert self.kv is not None
        return op.block_ids[op.skip_first_n_tokens // self.kv.block_size :]

    def _batch_attributes(self, ops: list[StoreOp] | list[RetrieveOp]) -> dict[str, Any]:
        return {
            a.NUM_REQUESTS: len(ops),
            a.REQUEST_IDS: [op.request_id for op in ops],
            a.KV_RANK: self.identity.kv_rank,
            a.RANK: self.identity.tp_rank,
            a.CHUNKS: sum(len(op.chunk_hashes) for op in ops),
            a.TOKENS: sum(op.end_token - op.start_token for op in ops),
            a.BLOCKS: sum(len(op.block_ids) for op in ops),
        }

    # -----------------------------------------------------------------------------------------
    # Lifecycle
    # -----------------------------------------------------------------------------------------

    def close(self) -> None:
        """Finishes the stores in flight (up to the timeout), abandons in-flight retrieves
        (aborted on the server) and leaves the server."""
        if self._stores and self.rpc.alive:
            self.progress_stores(self.rpc.timeout_s)
        for store in self._stores:
            reason = "worker closed before the store finished"
            self._abort(store.op_id, store.span, reason)
            self._end_store(store, reason)
        self._stores = []
        for retrieve in self._inflight:
            self._abort(retrieve.op_id, retrieve.span, "worker closed")
            _give_up(retrieve.span, "worker closed")
            self._end_retrieve_span(retrieve, ok=False, nbytes=0)
        self._inflight = []
        if self.kv is not None and self.rpc.alive:
            with contextlib.suppress(ServerUnavailable, RemoteError):
                self.rpc.call(p.UnregisterWorker(), timeout_s=1.0)
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self.faults is not None:
            self.faults.close()
        if self.shared is not None:
            self.shared.close()
            self.shared = None


def _device_done(done: DoneEvent, deadline: float) -> bool:
    """Whether the server's CUDA copies completed, polling until ``deadline`` at most."""
    while not done.done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(_DEVICE_POLL_S)
    return True


_DEVICE_POLL_S = 50e-6


def _slot_bytes(items: list[p.ItemSlots]) -> int:
    return sum(slot.nbytes for item in items for slot in item.slots if slot is not None)


def _op_attributes(op: StoreOp | RetrieveOp) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        a.REQUEST_ID: op.request_id,
        a.REQUEST_ATTEMPT: op.attempt,
        a.CHUNKS: len(op.chunk_hashes),
        a.TOKENS: op.end_token - op.start_token,
        a.BLOCKS: len(op.block_ids),
        a.RANGE_START: op.start_token,
        a.RANGE_END: op.end_token,
    }
    if isinstance(op, RetrieveOp):
        attributes[a.SKIP_FIRST_N_TOKENS] = op.skip_first_n_tokens
    return attributes


def _failed_item(op: RetrieveOp, failed_blocks: list[int], block_size: int) -> dict[str, Any]:
    """A failed load's item event: the first token of its first failed block."""
    failed = set(failed_blocks)
    index = next((i for i, block in enumerate(op.block_ids) if block in failed), None)
    first = op.end_token if index is None else op.start_token + index * block_size
    return {**_op_attributes(op), a.OK: index is None, a.FIRST_FAILED_TOKEN: first}


def _reply_or_error(future: Future[p.Reply], store: _Store) -> p.Reply | str:
    """The reply (or why there is none), adding its timing to the store's."""
    server_s, waited_s = reply_timing(future)
    store.server_s += server_s
    store.poll_wait_s += waited_s
    try:
        reply = future.result(0)
    except Exception as exc:
        return str(exc)
    if isinstance(reply, p.Error):
        return f"{reply.code}: {reply.message}"
    return reply


def _plan_or_error(future: Future[p.Reply] | None) -> p.RetrievePlan | str:
    if future is None:
        return "cache server unavailable; not retrieving"
    try:
        reply = future.result(0)
    except Exception as exc:
        return str(exc)
    if isinstance(reply, p.Error):
        return f"{reply.code}: {reply.message}"
    assert isinstance(reply, p.RetrievePlan)
    return reply


def _give_up(span: telemetry.Span, reason: str) -> bool:
    log.warning("%s", reason)
    span.set_attributes({a.OK: False, a.ERROR: reason})
    telemetry.fail(span, reason)
    return False
