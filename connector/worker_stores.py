"""The worker's stores: reserve slots, copy the blocks into the pool, commit.

Runs in each worker process. A store is one batch of a step's store ops, moved on by replies::

    BEGIN ──(plan)──► copy (the worker's; or the server's, already done or on its CUDA stream)
          ──► COMMIT ──(done)──► ended: its span, stats and chunk reports

:meth:`Stores.submit` sends the begin and returns at once (the forward pass never waits on the
network); :meth:`Stores.progress` moves every store on as far as its replies allow. A begin
that got no reply is aborted on the server; one a restarted server answers with an error code
of :data:`~connector.worker_registration.REGISTER_AGAIN` registers again and is retried once,
anew. A store commits nothing (``ok`` False) when its request was preempted before its copy,
when it straddles a restart, or when its copy failed.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import time
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field

from connector import worker_spans as spans
from connector.cuda_ipc import DoneEvent
from connector.kv_events import ChunkReport, store_reports
from connector.ops import StoreOp
from connector.stats import StatsRecorder
from connector.worker_registration import NoReply, Registration, settled
from testbed.core import protocol as p
from testbed.core import telemetry
from testbed.core.block_copy import item_copies
from testbed.core.telemetry import attributes as a

log = logging.getLogger(__name__)


class StoreStage(enum.Enum):
    BEGIN = "begin"
    """Waiting for the plan (the server's reservation)."""
    COMMIT = "commit"
    """Waiting for the commit's answer."""


@dataclass
class Store:
    ops: list[StoreOp]
    op_id: int
    epoch: int
    span: telemetry.Span
    started_ns: int
    future: Future[p.Reply] | None = None
    stage: StoreStage = StoreStage.BEGIN
    plan: p.StorePlan | None = None
    failure: str | None = None
    """Why the store commits nothing (``None``: it commits)."""
    cancelled: bool = False
    retried: bool = False
    timing: spans.OpTiming = field(default_factory=spans.OpTiming)
    ready_token: int | None = None
    """CUDA IPC: the ready event lent to this store (back to the ring when it ends)."""
    device_done: DoneEvent | None = None
    """CUDA IPC: the server's done event; the store commits once it has completed."""

    @property
    def in_flight(self) -> bool:
        return self.future is not None or self.device_done is not None


class Stores:
    """The stores of one worker in flight; what they did goes to ``stats``."""

    def __init__(self, registration: Registration, stats: StatsRecorder) -> None:
        self.registration = registration
        self.stats = stats
        self.inflight: list[Store] = []
        self.failed = 0
        """Stores (batches) that did not commit, since the client started."""
        self.report_chunks = False
        """Collect a :class:`ChunkReport` per chunk of every finished store (vLLM's KV events:
        the scheduler announces the chunks every writing rank stored)."""
        self._chunk_reports: list[ChunkReport] = []

    def store(self, ops: list[StoreOp], wait_s: float | None = None) -> bool:
        """Stores the chunks of ``ops`` and waits for the commit (tests and tools; engines use
        :meth:`submit` and :meth:`progress`); False if not (fully) stored."""
        if not ops or not self.registration.identity.writer:
            return True
        before = self.failed
        self.submit(ops)
        self.progress(self.registration.rpc.timeout_s * 2 if wait_s is None else wait_s)
        return self.failed == before and not self.inflight

    def submit(self, ops: list[StoreOp]) -> None:
        """Starts storing ``ops`` and returns at once: the forward pass never waits on the
        network. :meth:`progress` moves the store on (copy, commit) as replies come."""
        reg = self.registration
        if not ops or not reg.identity.writer:
            return
        assert reg.kv is not None, "register() first"
        span, started_ns = spans.start_batch(a.CONNECTOR_STORE, ops, reg.identity)
        store = Store(ops, reg.rpc.new_op_id(), reg.epoch, span, started_ns)
        span.set_attribute(a.OP_ID, store.op_id)
        if not reg.rpc.alive:
            self._end(store, "cache server unavailable; not storing")
            return
        reg.ensure_current()
        self._begin(store)
        self.inflight.append(store)

    def progress(self, wait_s: float = 0.0) -> None:
        """Moves every store on as far as its replies allow, waiting up to ``wait_s`` in all:
        a plan arrived → copy (worker-driven; CUDA IPC: the server's copies completed) →
        commit; a commit arrived → done."""
        deadline = time.monotonic() + wait_s
        self.inflight = [store for store in self.inflight if self._progress(store, deadline)]

    def cancel(self, request_ids: Iterable[str]) -> None:
        """The engine preempted these requests: their blocks may be reused, so stores whose
        copy has not happened yet are abandoned (aborted when their plan comes). Server-driven,
        the server copies while it plans, so this waits for those plans first."""
        cancelled = set(request_ids)
        if not cancelled:
            return
        for store in self.inflight:
            if store.stage is StoreStage.BEGIN and any(
                op.request_id in cancelled for op in store.ops
            ):
                store.cancelled = True
                if self.registration.shared is not None and store.future is not None:
                    # The server copies while it plans: its reply must be in before the next
                    # forward pass may write into the blocks (bounded by the RPC timeout).
                    _wait(store, self.registration.rpc.timeout_s)
                    self._order_after(store.future)

    @property
    def pending_requests(self) -> set[str]:
        """Requests with a store of this worker still in flight."""
        return {op.request_id for store in self.inflight for op in store.ops}

    def take_chunk_reports(self) -> list[ChunkReport]:
        """The chunks of the stores finished since the last call (see :attr:`report_chunks`)."""
        reports, self._chunk_reports = self._chunk_reports, []
        return reports

    def close(self) -> None:
        """Finishes the stores in flight (up to the timeout) and aborts the rest."""
        rpc = self.registration.rpc
        if self.inflight and rpc.alive:
            self.progress(rpc.timeout_s)
        for store in self.inflight:
            reason = "worker closed before the store finished"
            self.registration.abort(store.op_id, store.span, reason)
            self._end(store, reason)
        self.inflight = []

    # -----------------------------------------------------------------------------------------
    # The state machine
    # -----------------------------------------------------------------------------------------

    def _begin(self, store: Store) -> None:
        """Sends the store's begin (again, after registering anew) to the current instance."""
        reg = self.registration
        store.epoch = reg.epoch
        reg.release_ready(store.ready_token)
        store.ready_token, ready = reg.record_ready()
        store.future = reg.rpc.submit(
            p.StoreBegin(
                op_id=store.op_id,
                epoch=reg.epoch,
                items=reg.items(store.ops),
                traceparent=telemetry.traceparent_of(store.span) or store.ops[0].traceparent,
                ready_event=ready,
            )
        )

    def _progress(self, store: Store, deadline: float) -> bool:
        """Takes the store's replies until one is outstanding at ``deadline``; whether the
        store is still in flight."""
        while store.in_flight:
            if store.device_done is not None:
                if not store.device_done.done_by(deadline):
                    break
                store.device_done = None
                self._commit(store)
                continue
            assert store.future is not None
            remaining = deadline - time.monotonic()
            if not store.future.done() and remaining > 0:
                _wait(store, remaining)
            if not store.future.done():
                break
            self._advance(store)
        return store.in_flight

    def _advance(self, store: Store) -> None:
        """One reply of ``store`` arrived: take the next step."""
        assert store.future is not None
        store.timing.took(store.future)
        reply = settled(store.future)
        store.future = None
        if isinstance(reply, NoReply):
            self._refused(store, reply)
        elif store.stage is StoreStage.BEGIN:
            assert isinstance(reply, p.StorePlan)
            self._planned(store, reply)
        else:
            assert isinstance(reply, p.StoreDone)
            self._end(store, store.failure, reply.num_committed, reply.eviction_seq)

    def _refused(self, store: Store, failure: NoReply) -> None:
        reg = self.registration
        if store.stage is StoreStage.BEGIN:
            if failure.code is None:  # no plan came back: the server may still hold the op
                reg.abort(store.op_id, store.span, failure.reason)
            # A server that restarted before this worker heard of it answers (or fails) that
            # the worker is not registered: register once more, anew, and retry.
            if failure.register_again and not store.retried and reg.register_again():
                store.retried = True
                store.op_id = reg.rpc.new_op_id()
                self._begin(store)
                return
        self._end(store, f"store not committed: {failure.reason}")

    def _planned(self, store: Store, plan: p.StorePlan) -> None:
        reg = self.registration
        store.plan = plan
        if store.cancelled:
            store.failure = "the request was preempted before its blocks were copied"
        elif plan.epoch != store.epoch or reg.stale():
            store.failure = "the server restarted during the store"
        elif plan.done_event is not None and reg.cuda is not None:
            # CUDA IPC: commit once the server's copies have completed on its stream.
            store.device_done = reg.cuda.events.opened(plan.done_event)
            return
        elif not plan.copied:
            started = time.perf_counter()
            if not self._copy_in(store.ops, plan):
                store.failure = "copying KV into the pool failed"
            store.timing.copy_ms = (time.perf_counter() - started) * 1e3
        self._commit(store)

    def _commit(self, store: Store) -> None:
        commit = p.StoreCommit(
            op_id=store.op_id,
            ok=store.failure is None,
            traceparent=telemetry.traceparent_of(store.span),
        )
        store.stage = StoreStage.COMMIT
        store.future = self.registration.rpc.submit(commit)

    def _copy_in(self, ops: list[StoreOp], plan: p.StorePlan) -> bool:
        reg = self.registration
        if reg.pool is None:
            return True  # metadata-only server: nothing to copy
        assert reg.kv is not None
        copies = [
            copy
            for op, item in zip(ops, plan.items, strict=True)
            for copy in item_copies(op.block_ids, item.slots, reg.blocks_per_chunk)[0]
        ]
        try:
            if copies:
                reg.kv.store_chunks(reg.pool.array, copies)
        except (RuntimeError, ValueError, IndexError):
            log.exception("copying KV into the pool failed; aborting the store")
            return False
        return True

    def _order_after(self, future: Future[p.Reply]) -> None:
        """CUDA IPC: later work on the KV's stream waits for the copies of a plan that has
        arrived (a preempted request's blocks are read before they are reused)."""
        cuda = self.registration.cuda
        if cuda is None or not future.done():
            return
        with contextlib.suppress(Exception):
            plan = future.result(0)
            if isinstance(plan, p.StorePlan) and plan.done_event is not None:
                cuda.events.opened(plan.done_event).order_stream(cuda.events.device)

    def _end(
        self, store: Store, failure: str | None, committed: int = 0, eviction_seq: int = 0
    ) -> None:
        self.registration.release_ready(store.ready_token)
        ok = failure is None
        plan = store.plan
        nbytes = spans.store_ended(
            store.span, store.ops, plan, ok=ok, num_committed=committed, timing=store.timing
        )
        if not ok:
            self.failed += 1
            spans.give_up(store.span, failure or "store failed")
        if self.report_chunks:
            slots = None if not ok or plan is None else [item.slots for item in plan.items]
            full = None if slots is None or plan is None else [i.num_full for i in plan.items]
            kv_rank = self.registration.identity.kv_rank
            self._chunk_reports += store_reports(kv_rank, store.ops, slots, eviction_seq, full)
        seconds = spans.end_batch(store.span, store.started_ns)
        self.stats.store(nbytes=nbytes, ok=ok, seconds=seconds)


def _wait(store: Store, timeout_s: float) -> None:
    """Holds the engine's step until the store's reply is in (or ``timeout_s`` passed)."""
    assert store.future is not None
    blocked_at = time.monotonic()
    with contextlib.suppress(Exception):  # a failed future is taken by _advance
        store.future.result(timeout_s)
    store.timing.step_wait_s += time.monotonic() - blocked_at
