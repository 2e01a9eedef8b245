"""The worker's retrieves: ask for the plan, copy out of the pool, release the pins.

Runs in each worker process. A retrieve is asynchronous: :meth:`Retrieves.submit` sends the
begin and returns; :meth:`Retrieves.complete` copies the chunks the plan names (server-driven:
the server copied them already) and ends the retrieve (``RetrieveEnd``: the server releases
the pins), reporting the finished requests and the blocks that could not be loaded (chunks
evicted or expired since the lookup, a dead or restarted server, an unconfirmed release) so
the engine recomputes them.

A load counts only when the server confirmed its release (``RetrieveDone``): that proves the
pins held during the copy; otherwise its blocks are reported failed. A retrieve given up on
(no answer in time, no answer before a synchronous forward pass) is aborted on the server.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field

from connector import worker_spans as spans
from connector.cuda_ipc import DoneEvent
from connector.faults import FaultInjector
from connector.ops import RetrieveOp
from connector.stats import StatsRecorder
from connector.worker_registration import NoReply, Registration, settled
from testbed.core import protocol as p
from testbed.core import telemetry
from testbed.core.block_copy import ChunkCopy, item_copies
from testbed.core.rpc import RemoteError, ServerUnavailable
from testbed.core.telemetry import attributes as a

log = logging.getLogger(__name__)


@dataclass
class RetrieveOutcome:
    finished: set[str] = field(default_factory=set)
    """Requests whose retrieves ended, loaded or not."""
    failed_block_ids: set[int] = field(default_factory=set)
    """Blocks that were not loaded (the engine recomputes them)."""


@dataclass
class Retrieve:
    ops: list[RetrieveOp]
    op_id: int
    epoch: int
    future: Future[p.Reply] | None
    """``None`` when the begin was never sent (the server looked down)."""
    span: telemetry.Span
    started_at: float
    started_ns: int
    """The span's start (wall clock, ns): its duration is exactly what the stats record."""
    ready_token: int | None = None
    """CUDA IPC: the ready event lent to this retrieve (back to the ring when it ends)."""
    device_done: DoneEvent | None = None
    """CUDA IPC: the server's done event, once the plan named it."""


@dataclass
class _Loaded:
    """What a planned retrieve moved: per item ok and failed blocks, bytes, the release."""

    oks: list[bool]
    failed: list[list[int]]
    nbytes: int
    num_locks_released: int
    confirmed: bool
    """Whether the server confirmed the release (only then do the loads count)."""


class Retrieves:
    """The retrieves of one worker in flight; what they did goes to ``stats``."""

    def __init__(
        self, registration: Registration, stats: StatsRecorder, faults: FaultInjector | None
    ) -> None:
        self.registration = registration
        self.stats = stats
        self.faults = faults
        self.inflight: list[Retrieve] = []

    def submit(self, ops: list[RetrieveOp]) -> None:
        """Starts retrieving ``ops``; :meth:`complete` finishes them."""
        if not ops:
            return
        reg = self.registration
        span, started_ns = spans.start_batch(a.CONNECTOR_RETRIEVE, ops, reg.identity)
        op_id = reg.rpc.new_op_id()
        future = None
        if self.faults is not None:
            self.faults.before_retrieve(ops)
        token = None
        if reg.rpc.alive:
            reg.ensure_current()
            token, ready = reg.record_ready()
            request = p.RetrieveBegin(
                op_id=op_id,
                epoch=reg.epoch,
                items=reg.items(ops),
                traceparent=telemetry.traceparent_of(span) or ops[0].traceparent,
                ready_event=ready,
            )
            future = reg.rpc.submit(request)
        span.set_attribute(a.OP_ID, op_id)
        self.inflight.append(
            Retrieve(ops, op_id, reg.epoch, future, span, time.monotonic(), started_ns, token)
        )

    def complete(self, wait_s: float = 0.0, *, fail_outstanding: bool = False) -> RetrieveOutcome:
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
        self.inflight = [
            retrieve
            for retrieve in self.inflight
            if not self._try_finish(retrieve, outcome, deadline, fail_outstanding)
        ]
        return outcome

    def close(self) -> None:
        """Abandons the retrieves in flight (aborted on the server)."""
        for retrieve in self.inflight:
            self.registration.abort(retrieve.op_id, retrieve.span, "worker closed")
            spans.give_up(retrieve.span, "worker closed")
            self._end_span(retrieve, ok=False, nbytes=0)
        self.inflight = []

    # -----------------------------------------------------------------------------------------
    # Finishing a retrieve
    # -----------------------------------------------------------------------------------------

    def _try_finish(
        self, retrieve: Retrieve, outcome: RetrieveOutcome, deadline: float, fail_outstanding: bool
    ) -> bool:
        """Finishes ``retrieve`` into ``outcome`` if it can by ``deadline``; whether it did."""
        future = retrieve.future
        remaining = deadline - time.monotonic()
        if future is not None and not future.done() and remaining > 0:
            with contextlib.suppress(Exception):  # a failed future is handled below
                future.result(remaining)
        if future is not None and not future.done():
            if not fail_outstanding:
                return False
            future.cancel()
            reason = "no answer before the forward pass"
            self.registration.abort(retrieve.op_id, retrieve.span, reason)
            self._fail_all(retrieve, outcome, reason)
            return True
        if not self._copies_done(retrieve, deadline, fail_outstanding):
            return False
        self._finish(retrieve, outcome)
        return True

    def _copies_done(self, retrieve: Retrieve, deadline: float, wait: bool) -> bool:
        """CUDA IPC: whether the server's copies of an answered retrieve have completed
        (``wait``: blocks until they have); True for every other retrieve."""
        cuda = self.registration.cuda
        if retrieve.device_done is None and cuda is not None and retrieve.future is not None:
            plan = settled(retrieve.future)
            if isinstance(plan, p.RetrievePlan) and plan.done_event is not None:
                retrieve.device_done = cuda.events.opened(plan.done_event)
        if retrieve.device_done is None:
            return True
        if wait:
            retrieve.device_done.wait()
            return True
        return retrieve.device_done.done_by(deadline)

    def _finish(self, retrieve: Retrieve, outcome: RetrieveOutcome) -> None:
        reg = self.registration
        reg.release_ready(retrieve.ready_token)
        retrieve.ready_token = None
        if retrieve.future is None:
            self._fail_all(retrieve, outcome, "cache server unavailable; not retrieving")
            return
        plan = settled(retrieve.future)
        if isinstance(plan, NoReply):
            self._refused(retrieve, outcome, plan)
            return
        assert isinstance(plan, p.RetrievePlan)
        if plan.epoch != reg.epoch or reg.stale():
            reason = "the server restarted during the retrieve"
            reg.abort(retrieve.op_id, retrieve.span, reason)
            self._fail_all(retrieve, outcome, reason)
            return
        timing = spans.OpTiming()
        timing.took(retrieve.future)
        loaded = self._load(retrieve, plan, timing)
        self._report(retrieve, outcome, plan, loaded, timing)

    def _refused(self, retrieve: Retrieve, outcome: RetrieveOutcome, failure: NoReply) -> None:
        if failure.code is None:
            # No answer (a timeout): whatever the server pins for it when it gets to it is
            # unowned by anyone waiting; release it then rather than at its deadline.
            self.registration.abort(retrieve.op_id, retrieve.span, failure.reason)
        if failure.register_again:
            self.registration.register_again()
        self._fail_all(retrieve, outcome, failure.reason)

    def _load(self, retrieve: Retrieve, plan: p.RetrievePlan, timing: spans.OpTiming) -> _Loaded:
        """The planned retrieve's copies (the worker's, or the server's) and its release."""
        if plan.copied:  # server-driven: it copied while the objects were pinned
            oks, failed, nbytes = self._missing(retrieve.ops, plan)
            if plan.done_event is None:
                return _Loaded(oks, failed, nbytes, plan.num_locks_released, True)
        else:
            started = time.perf_counter()
            oks, failed, nbytes = self._copy_out(retrieve.ops, plan)
            timing.copy_ms = (time.perf_counter() - started) * 1e3
        # The worker copied, or (CUDA IPC) the server's copies completed: now unpin.
        released, confirmed = self._end_retrieve(retrieve, oks, timing)
        return _Loaded(oks, failed, nbytes, released, confirmed)

    def _report(
        self,
        retrieve: Retrieve,
        outcome: RetrieveOutcome,
        plan: p.RetrievePlan,
        loaded: _Loaded,
        timing: spans.OpTiming,
    ) -> None:
        reg, span = self.registration, retrieve.span
        missing = 0
        for op, blocks in zip(retrieve.ops, loaded.failed, strict=True):
            if not loaded.confirmed:
                blocks = reg.loadable_blocks(op)
            outcome.finished.add(op.request_id)
            outcome.failed_block_ids.update(blocks)
            missing += bool(blocks)
            event = (
                spans.failed_item(op, blocks, reg.block_size) if blocks else spans.loaded_item(op)
            )
            span.add_event(a.ITEM_EVENT, event)
        retrieved = loaded.nbytes if loaded.confirmed else 0
        spans.retrieve_ended(
            span,
            plan,
            oks=loaded.oks,
            confirmed=loaded.confirmed,
            nbytes=retrieved,
            num_locks_released=loaded.num_locks_released,
            timing=timing,
            wait_s=time.monotonic() - retrieve.started_at,
        )
        if missing:
            telemetry.fail(
                span,
                f"{missing} requests could not load every chunk; their blocks are recomputed"
                if loaded.confirmed
                else "the server did not confirm the release; every load is recomputed",
            )
        ok = loaded.confirmed and all(loaded.oks)
        self._end_span(retrieve, ok=ok, nbytes=retrieved)

    def _fail_all(self, retrieve: Retrieve, outcome: RetrieveOutcome, reason: str) -> None:
        reg = self.registration
        reg.release_ready(retrieve.ready_token)
        for op in retrieve.ops:
            blocks = reg.loadable_blocks(op)
            outcome.failed_block_ids.update(blocks)
            outcome.finished.add(op.request_id)
            retrieve.span.add_event(a.ITEM_EVENT, spans.failed_item(op, blocks, reg.block_size))
        spans.give_up(retrieve.span, reason)
        self._end_span(retrieve, ok=False, nbytes=0)

    def _end_span(self, retrieve: Retrieve, *, ok: bool, nbytes: int) -> None:
        seconds = spans.end_batch(retrieve.span, retrieve.started_ns)
        self.stats.retrieve(nbytes=nbytes, ok=ok, seconds=seconds)

    def _end_retrieve(
        self, retrieve: Retrieve, oks: list[bool], timing: spans.OpTiming
    ) -> tuple[int, bool]:
        """Releases the pins; (lock units released, whether the server confirmed)."""
        try:
            done = self.registration.rpc.call(
                p.RetrieveEnd(
                    op_id=retrieve.op_id,
                    ok=oks,
                    traceparent=telemetry.traceparent_of(retrieve.span),
                ),
                trips=timing,
            )
        except (ServerUnavailable, RemoteError) as exc:
            log.warning("retrieve end not confirmed; its loads count as failed: %s", exc)
            return 0, False
        assert isinstance(done, p.RetrieveDone)
        return done.num_locks_released, True

    # -----------------------------------------------------------------------------------------
    # Copies
    # -----------------------------------------------------------------------------------------

    def _item_copies(
        self, ops: list[RetrieveOp], plan: p.RetrievePlan
    ) -> Iterator[tuple[RetrieveOp, list[ChunkCopy], list[int]]]:
        """Per op: its chunk copies from the plan's slots and the blocks of missing chunks
        (both past the op's skipped blocks)."""
        reg = self.registration
        for op, item in zip(ops, plan.items, strict=True):
            skip_blocks = op.skip_first_n_tokens // reg.block_size
            copies, missing = item_copies(
                op.block_ids, item.slots, reg.blocks_per_chunk, skip_blocks
            )
            yield op, copies, missing

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

    def _copy_out(
        self, ops: list[RetrieveOp], plan: p.RetrievePlan
    ) -> tuple[list[bool], list[list[int]], int]:
        """Copies what is present; per item: ok, the blocks that failed, and bytes copied."""
        reg = self.registration
        assert reg.kv is not None
        oks: list[bool] = []
        failed: list[list[int]] = []
        nbytes = 0
        for op, copies, item_failed in self._item_copies(ops, plan):
            try:
                nbytes += sum(copy.slot.nbytes for copy in copies)
                if copies and reg.pool is not None:  # one batched copy per request
                    reg.kv.load_chunks(reg.pool.array, copies)
            except (RuntimeError, ValueError, IndexError) as exc:
                log.error("copying KV out of the pool failed for %s: %s", op.request_id, exc)
                item_failed = reg.loadable_blocks(op)
            oks.append(not item_failed)
            failed.append(item_failed)
        return oks, failed, nbytes
