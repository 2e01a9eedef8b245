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
  ``op_id``, so no reservation or pin outlives the worker's interest.

Every batch leaves one CLIENT span parented on its first request's context, linked to all of
them, with one ``kvcache.item`` event per request (range, attempt, and for a failed load the
first token of the first failed block).
"""

from __future__ import annotations

import contextlib
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from connector.faults import FaultInjector
from connector.kv_copy import PagedKV, PoolMapping
from connector.ops import RetrieveOp, StoreOp
from testbed import protocol as p
from testbed import telemetry
from testbed.rpc import RemoteError, RpcClient, ServerUnavailable
from testbed.telemetry import SpanKind
from testbed.telemetry import attributes as a

log = logging.getLogger(__name__)

_REGISTER_AGAIN = ("not_registered", "stale_epoch")


@dataclass(frozen=True)
class WorkerIdentity:
    model: str
    world_size: int
    """KV world size: TP ranks without MLA, 1 with MLA (one latent copy for all ranks)."""
    kv_rank: int
    tp_size: int = 1
    tp_rank: int = 0
    mla: bool = False
    writer: bool = True
    """Whether this rank stores (with MLA only the first rank writes)."""

    @classmethod
    def for_rank(cls, model: str, tp_size: int, tp_rank: int, mla: bool) -> WorkerIdentity:
        """TP rank ``tp_rank``'s identity: its own shard of the heads (KV rank = TP rank), or
        with MLA the one latent copy all ranks share (KV rank 0, written by rank 0)."""
        return cls(
            model=model,
            world_size=kv_world_size(tp_size, mla),
            kv_rank=0 if mla else tp_rank,
            tp_size=tp_size,
            tp_rank=tp_rank,
            mla=mla,
            writer=tp_rank == 0 or not mla,
        )


def kv_world_size(tp_size: int, mla: bool) -> int:
    """KV ranks whose objects make up a chunk: every TP rank's shard, or one MLA latent."""
    return 1 if mla else tp_size


def readers_per_object(tp_size: int, mla: bool) -> int:
    """Ranks that read each object: its own rank, or with MLA every TP rank."""
    return tp_size if mla else 1


@dataclass
class _Retrieve:
    ops: list[RetrieveOp]
    op_id: int
    epoch: int
    future: Future[p.Reply] | None
    span: telemetry.Span
    started_at: float


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

    # -----------------------------------------------------------------------------------------
    # Registration
    # -----------------------------------------------------------------------------------------

    def register(self, kv: PagedKV) -> None:
        """Announces the layout and maps the server's pool (unmapping another instance's);
        raises if the server refuses or is down."""
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

    def _begin(self, make: Any) -> p.Reply:
        """Sends a begin request built by ``make(epoch)``; registers again and retries once
        when the server does not know this worker or its epoch (it restarted)."""
        self._ensure_current()
        try:
            return self.rpc.call(make(self.epoch))
        except RemoteError as exc:
            if exc.code not in _REGISTER_AGAIN or self.kv is None:
                raise
            log.warning("cache server lost our registration (%s); registering again", exc.code)
            self.register(self.kv)
            return self.rpc.call(make(self.epoch))

    # -----------------------------------------------------------------------------------------
    # Store
    # -----------------------------------------------------------------------------------------

    def store(self, ops: list[StoreOp]) -> bool:
        """Stores the chunks of ``ops``; False if the batch was not (fully) stored."""
        if not ops or not self.identity.writer:
            return True
        assert self.kv is not None, "register() first"
        with telemetry.traced(
            a.CONNECTOR_STORE,
            kind=SpanKind.CLIENT,
            parent=ops[0].traceparent,
            links=[op.traceparent for op in ops],
            attributes=self._batch_attributes(ops),
        ) as span:
            if not self.rpc.alive:
                self._store_items(span, ops, None, committed=False)
                return _give_up(span, "cache server unavailable; not storing")
            op_id = self.rpc.new_op_id()
            try:
                traceparent, tracestate = telemetry.inject()
                traceparent = traceparent or ops[0].traceparent  # untraced worker: the request
                plan = self._begin(
                    lambda epoch: p.StoreBegin(
                        op_id=op_id,
                        epoch=epoch,
                        items=_items(ops),
                        traceparent=traceparent,
                        tracestate=tracestate,
                    )
                )
                assert isinstance(plan, p.StorePlan)
                started = time.perf_counter()
                ok = self._copy_in(ops, plan) if plan.epoch == self.epoch else False
                copy_ms = (time.perf_counter() - started) * 1e3
                commit = p.StoreCommit(
                    op_id=op_id, ok=ok, traceparent=traceparent, tracestate=tracestate
                )
                done = self.rpc.call(commit)
            except (ServerUnavailable, RemoteError) as exc:
                self._abort([op_id])
                self._store_items(span, ops, None, committed=False)
                return _give_up(span, f"store not committed: {exc}")
            assert isinstance(done, p.StoreDone)
            self._store_items(span, ops, plan, committed=ok)
            span.set_attributes(
                {
                    a.OP_ID: op_id,
                    a.OK: ok,
                    a.CHUNKS_WRITTEN: done.num_committed,
                    a.CHUNKS_PRESENT: sum(item.num_present for item in plan.items),
                    a.CHUNKS_FULL: sum(item.num_full for item in plan.items),
                    a.BYTES: _slot_bytes(plan.items) if ok else 0,
                    a.COPY_MS: copy_ms,
                }
            )
            if not ok:
                telemetry.fail(span, "copying KV into the pool failed; the store was aborted")
            return ok

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
        per_chunk = self.blocks_per_chunk
        try:
            for op, item in zip(ops, plan.items, strict=True):
                for index, slot in enumerate(item.slots):
                    if slot is not None:
                        blocks = op.block_ids[index * per_chunk : (index + 1) * per_chunk]
                        self.kv.save(self._pool.tensor, slot, blocks)
        except (RuntimeError, ValueError, IndexError):
            log.exception("copying KV into the pool failed; aborting the store")
            return False
        return True

    def _abort(self, op_ids: list[int]) -> None:
        """Tells the server to drop operations this worker gave up on (fire and forget; if
        the server is gone, its operation deadline cleans up)."""
        if op_ids and self.rpc.alive:
            with contextlib.suppress(ServerUnavailable):
                self.rpc.fire(p.Abort(op_ids=op_ids))

    # -----------------------------------------------------------------------------------------
    # Retrieve
    # -----------------------------------------------------------------------------------------

    def submit_retrieves(self, ops: list[RetrieveOp]) -> None:
        """Starts retrieving ``ops``; :meth:`complete_retrieves` finishes them."""
        if not ops:
            return
        span = telemetry.start_span(
            a.CONNECTOR_RETRIEVE,
            kind=SpanKind.CLIENT,
            parent=ops[0].traceparent,
            links=[op.traceparent for op in ops],
            attributes=self._batch_attributes(ops),
        )
        op_id = self.rpc.new_op_id()
        future = None
        if self.faults is not None:
            self.faults.before_retrieve(ops)
        if self.rpc.alive:
            with contextlib.suppress(ServerUnavailable, RemoteError):
                self._ensure_current()
            request = p.RetrieveBegin(
                op_id=op_id,
                epoch=self.epoch,
                items=_items(ops),
                traceparent=telemetry.traceparent_of(span) or ops[0].traceparent,
            )
            future = self.rpc.submit(request)
        span.set_attribute(a.OP_ID, op_id)
        self._inflight.append(_Retrieve(ops, op_id, self.epoch, future, span, time.monotonic()))

    @property
    def num_inflight_retrieves(self) -> int:
        return len(self._inflight)

    def complete_retrieves(
        self, wait_s: float = 0.0, *, fail_outstanding: bool = False
    ) -> RetrieveOutcome:
        """Finishes the retrieves whose plan has arrived (waiting up to ``wait_s`` for all).

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
                self._abort([retrieve.op_id])
                self._fail_all(retrieve, outcome, "no answer before the forward pass")
                continue
            self._finish(retrieve, outcome)
        self._inflight = still
        return outcome

    def _fail_all(self, retrieve: _Retrieve, outcome: RetrieveOutcome, reason: str) -> None:
        assert self.kv is not None
        for op in retrieve.ops:
            blocks = self._loadable_blocks(op)
            outcome.failed_block_ids.update(blocks)
            outcome.finished.add(op.request_id)
            retrieve.span.add_event(a.ITEM_EVENT, _failed_item(op, blocks, self.kv.block_size))
        _give_up(retrieve.span, reason)
        retrieve.span.end()

    def _finish(self, retrieve: _Retrieve, outcome: RetrieveOutcome) -> None:
        span = retrieve.span
        plan = _plan_or_error(retrieve.future)
        if isinstance(plan, str):
            if "not_registered" in plan or "stale_epoch" in plan:
                with contextlib.suppress(ServerUnavailable, RemoteError):
                    assert self.kv is not None
                    self.register(self.kv)
            self._fail_all(retrieve, outcome, plan)
            return
        if plan.epoch != self.epoch or self._stale():
            self._abort([retrieve.op_id])
            self._fail_all(retrieve, outcome, "the server restarted during the retrieve")
            return
        started = time.perf_counter()
        oks, failed, nbytes = self._copy_out(retrieve.ops, plan)
        copy_ms = (time.perf_counter() - started) * 1e3
        released = 0
        confirmed = False
        try:
            done = self.rpc.call(
                p.RetrieveEnd(
                    op_id=retrieve.op_id, ok=oks, traceparent=telemetry.traceparent_of(span)
                )
            )
            assert isinstance(done, p.RetrieveDone)
            released = done.num_locks_released
            confirmed = True
        except (ServerUnavailable, RemoteError) as exc:
            log.warning("retrieve end not confirmed; its loads count as failed: %s", exc)
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
        span.set_attributes(
            {
                a.OK: confirmed and all(oks),
                a.CHUNKS_MISSING: sum(not ok for ok in oks),
                a.BYTES: nbytes if confirmed else 0,
                a.LOCKS_RELEASED: released,
                a.COPY_MS: copy_ms,
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
        span.end()

    def _stale(self) -> bool:
        return self.rpc.server_epoch not in (0, self.epoch)

    def _copy_out(
        self, ops: list[RetrieveOp], plan: p.RetrievePlan
    ) -> tuple[list[bool], list[list[int]], int]:
        """Copies what is present; per item: ok, the blocks that failed, and bytes copied."""
        assert self.kv is not None
        per_chunk = self.blocks_per_chunk
        oks: list[bool] = []
        failed: list[list[int]] = []
        nbytes = 0
        for op, item in zip(ops, plan.items, strict=True):
            skip_blocks = op.skip_first_n_tokens // self.kv.block_size
            item_failed: list[int] = []
            try:
                for index, slot in enumerate(item.slots):
                    chunk_blocks = op.block_ids[index * per_chunk : (index + 1) * per_chunk]
                    skip = min(max(0, skip_blocks - index * per_chunk), len(chunk_blocks))
                    if slot is None:
                        item_failed += chunk_blocks[skip:]
                        continue
                    if self._pool is not None:
                        self.kv.load(self._pool.tensor, slot, chunk_blocks, skip)
                    nbytes += slot.nbytes
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
        """Abandons in-flight retrieves (aborted on the server) and leaves the server."""
        self._abort([retrieve.op_id for retrieve in self._inflight])
        for retrieve in self._inflight:
            _give_up(retrieve.span, "worker closed")
            retrieve.span.end()
        self._inflight = []
        if self.kv is not None and self.rpc.alive:
            with contextlib.suppress(ServerUnavailable, RemoteError):
                self.rpc.call(p.UnregisterWorker(), timeout_s=1.0)
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self.faults is not None:
            self.faults.close()


def _items(ops: list[StoreOp] | list[RetrieveOp]) -> list[p.OpItem]:
    return [
        p.OpItem(
            session_id=op.session_id,
            cache_salt=op.cache_salt,
            chunk_hashes=op.chunk_hashes,
            first_chunk=op.first_chunk,
            handle=op.handle,
            traceparent=op.traceparent,
        )
        for op in ops
    ]


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
