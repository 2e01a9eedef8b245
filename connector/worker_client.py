"""Worker-side client: registers the KV caches, stores and retrieves batches of chunks.

Runs in each worker process (one per TP rank). A store is synchronous and short: reserve
slots (one round trip), copy the blocks into the shared pool, commit. A retrieve is
asynchronous: :meth:`WorkerClient.submit_retrieves` sends the request and returns; the copy
and the release happen in :meth:`WorkerClient.complete_retrieves`, which reports the finished
requests and the blocks that could not be loaded (chunks evicted or expired since the lookup,
or a dead server) so the engine recomputes them. Every batch leaves one CLIENT span parented
on its first request's context, linked to all of them, with one event per request.
"""

from __future__ import annotations

import contextlib
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from connector.kv_copy import PagedKV, PoolMapping
from connector.ops import RetrieveOp, StoreOp
from testbed import protocol as p
from testbed import telemetry
from testbed.rpc import RemoteError, RpcClient, ServerUnavailable
from testbed.telemetry import SpanKind
from testbed.telemetry import attributes as a

log = logging.getLogger(__name__)


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
    future: Future[p.Reply] | None
    span: telemetry.Span
    started_at: float


@dataclass
class RetrieveOutcome:
    finished: set[str] = field(default_factory=set)
    failed_block_ids: set[int] = field(default_factory=set)
    failed_tokens: dict[str, int] = field(default_factory=dict)
    """Per request: tokens that were to be loaded but were not (the engine recomputes them)."""

    def fail(self, request_id: str, block_ids: list[int], block_size: int) -> None:
        self.failed_block_ids.update(block_ids)
        self.failed_tokens[request_id] = (
            self.failed_tokens.get(request_id, 0) + len(block_ids) * block_size
        )


class WorkerClient:
    def __init__(self, rpc: RpcClient, identity: WorkerIdentity) -> None:
        self.rpc = rpc
        self.identity = identity
        self.kv: PagedKV | None = None
        self.chunk_size = 0
        self._pool: PoolMapping | None = None
        self._inflight: list[_Retrieve] = []

    # -----------------------------------------------------------------------------------------
    # Registration
    # -----------------------------------------------------------------------------------------

    def register(self, kv: PagedKV) -> None:
        """Announces the layout and maps the pool; raises if the server refuses or is down."""
        self.kv = kv
        ident = self.identity
        reply = self.rpc.call(
            p.RegisterWorker(
                model=ident.model,
                world_size=ident.world_size,
                kv_rank=ident.kv_rank,
                tp_size=ident.tp_size,
                mla=ident.mla,
                layout=kv.layout(),
            )
        )
        assert isinstance(reply, p.WorkerRegistered)
        self.chunk_size = reply.chunk_size
        if self._pool is None and reply.pool_path:
            self._pool = PoolMapping(reply.pool_path, reply.pool_bytes)

    @property
    def blocks_per_chunk(self) -> int:
        assert self.kv is not None
        return self.chunk_size // self.kv.block_size

    def _call_registered(self, request: p.Request) -> p.Reply:
        """Calls; if the server forgot us (it restarted), registers again and retries once."""
        try:
            return self.rpc.call(request)
        except RemoteError as exc:
            if exc.code != "not_registered" or self.kv is None:
                raise
            log.warning("cache server lost our registration; registering again")
            self.register(self.kv)
            return self.rpc.call(request)

    # -----------------------------------------------------------------------------------------
    # Store
    # -----------------------------------------------------------------------------------------

    def store(self, ops: list[StoreOp]) -> bool:
        """Stores the chunks of ``ops``; False if the batch was not stored (server down)."""
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
                return _give_up(span, "cache server unavailable; not storing")
            try:
                traceparent, tracestate = telemetry.inject()
                begin = p.StoreBegin(
                    items=_items(ops), traceparent=traceparent, tracestate=tracestate
                )
                plan = self._call_registered(begin)
                assert isinstance(plan, p.StorePlan)
                started = time.perf_counter()
                ok = self._copy_in(ops, plan)
                copy_ms = (time.perf_counter() - started) * 1e3
                commit = p.StoreCommit(
                    store_id=plan.store_id, ok=ok, traceparent=traceparent, tracestate=tracestate
                )
                done = self.rpc.call(commit)
            except (ServerUnavailable, RemoteError) as exc:
                return _give_up(span, str(exc))
            assert isinstance(done, p.StoreDone)
            written = sum(slot is not None for item in plan.items for slot in item.slots)
            span.set_attributes(
                {
                    a.OK: ok,
                    a.CHUNKS_WRITTEN: done.num_committed,
                    a.CHUNKS_PRESENT: sum(item.num_present for item in plan.items),
                    a.CHUNKS_FULL: sum(item.num_full for item in plan.items),
                    a.BYTES: sum(slot.nbytes for item in plan.items for slot in item.slots if slot),
                    a.COPY_MS: copy_ms,
                }
            )
            for op, item in zip(ops, plan.items, strict=True):
                span.add_event(
                    a.ITEM_EVENT,
                    {
                        **_op_attributes(op),
                        a.CHUNKS_WRITTEN: sum(slot is not None for slot in item.slots),
                        a.CHUNKS_PRESENT: item.num_present,
                        a.CHUNKS_FULL: item.num_full,
                    },
                )
            return ok and written == done.num_committed

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
        future = None
        if self.rpc.alive:
            request = p.RetrieveBegin(items=_items(ops), traceparent=telemetry.traceparent_of(span))
            future = self.rpc.submit(request)
        self._inflight.append(_Retrieve(ops, future, span, time.monotonic()))

    @property
    def num_inflight_retrieves(self) -> int:
        return len(self._inflight)

    def complete_retrieves(self, wait_s: float = 0.0) -> RetrieveOutcome:
        """Finishes the retrieves whose plan has arrived (waiting up to ``wait_s`` for all).

        Every finished request is reported, including those whose load failed; the failed
        chunks' blocks (minus the skipped ones) are in ``failed_block_ids``.
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
                still.append(retrieve)
                continue
            self._finish(retrieve, outcome)
        self._inflight = still
        return outcome

    def _finish(self, retrieve: _Retrieve, outcome: RetrieveOutcome) -> None:
        span = retrieve.span
        plan = _plan_or_error(retrieve.future)
        if isinstance(plan, str):
            assert self.kv is not None
            for op in retrieve.ops:
                outcome.fail(op.request_id, self._loadable_blocks(op), self.kv.block_size)
                outcome.finished.add(op.request_id)
            _give_up(span, plan)
            span.end()
            return
        started = time.perf_counter()
        oks, missing, nbytes = self._copy_out(retrieve.ops, plan, outcome, span)
        copy_ms = (time.perf_counter() - started) * 1e3
        released = 0
        try:
            done = self.rpc.call(
                p.RetrieveEnd(
                    retrieve_id=plan.retrieve_id, ok=oks, traceparent=telemetry.traceparent_of(span)
                )
            )
            assert isinstance(done, p.RetrieveDone)
            released = done.num_locks_released
        except (ServerUnavailable, RemoteError) as exc:
            log.warning("retrieve end not acknowledged (locks expire by TTL): %s", exc)
        span.set_attributes(
            {
                a.OK: all(oks),
                a.CHUNKS_MISSING: missing,
                a.BYTES: nbytes,
                a.LOCKS_RELEASED: released,
                a.COPY_MS: copy_ms,
                a.WAIT_MS: (time.monotonic() - retrieve.started_at) * 1e3,
            }
        )
        if not all(oks):
            telemetry.fail(span, f"{missing} chunks were gone; their blocks will be recomputed")
        span.end()

    def _copy_out(
        self,
        ops: list[RetrieveOp],
        plan: p.RetrievePlan,
        outcome: RetrieveOutcome,
        span: telemetry.Span,
    ) -> tuple[list[bool], int, int]:
        assert self.kv is not None
        per_chunk = self.blocks_per_chunk
        block_size = self.kv.block_size
        oks: list[bool] = []
        missing_total = nbytes = 0
        for op, item in zip(ops, plan.items, strict=True):
            outcome.finished.add(op.request_id)
            skip_blocks = op.skip_first_n_tokens // block_size
            missing = 0
            try:
                for index, slot in enumerate(item.slots):
                    chunk_blocks = op.block_ids[index * per_chunk : (index + 1) * per_chunk]
                    skip = min(max(0, skip_blocks - index * per_chunk), len(chunk_blocks))
                    if slot is None:
                        missing += 1
                        outcome.fail(op.request_id, chunk_blocks[skip:], block_size)
                        continue
                    if self._pool is not None:
                        self.kv.load(self._pool.tensor, slot, chunk_blocks, skip)
                    nbytes += slot.nbytes
            except (RuntimeError, ValueError, IndexError) as exc:
                log.error("copying KV out of the pool failed for %s: %s", op.request_id, exc)
                missing = len(item.slots)
                outcome.fail(op.request_id, self._loadable_blocks(op), block_size)
            oks.append(missing == 0)
            missing_total += missing
            span.add_event(
                a.ITEM_EVENT, {**_op_attributes(op), a.CHUNKS_MISSING: missing, a.OK: missing == 0}
            )
        return oks, missing_total, nbytes

    def _loadable_blocks(self, op: RetrieveOp) -> list[int]:
        assert self.kv is not None
        return op.block_ids[op.skip_first_n_tokens // self.kv.block_size :]

    def _batch_attributes(self, ops: list[StoreOp] | list[RetrieveOp]) -> dict[str, Any]:
        assert self.kv is not None
        attributes: dict[str, Any] = {
            a.NUM_REQUESTS: len(ops),
            a.REQUEST_IDS: [op.request_id for op in ops],
            a.KV_RANK: self.identity.kv_rank,
            a.RANK: self.identity.tp_rank,
            a.CHUNKS: sum(len(op.chunk_hashes) for op in ops),
            a.TOKENS: sum(op.end_token - op.start_token for op in ops),
            a.BLOCKS: sum(len(op.block_ids) for op in ops),
        }
        return attributes

    # -----------------------------------------------------------------------------------------
    # Lifecycle
    # -----------------------------------------------------------------------------------------

    def close(self) -> None:
        """Abandons in-flight retrieves (their locks expire) and leaves the server."""
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


def _items(ops: list[StoreOp] | list[RetrieveOp]) -> list[p.OpItem]:
    return [
        p.OpItem(
            session_id=op.session_id,
            cache_salt=op.cache_salt,
            chunk_hashes=op.chunk_hashes,
            first_chunk=op.first_chunk,
            traceparent=op.traceparent,
        )
        for op in ops
    ]


def _op_attributes(op: StoreOp | RetrieveOp) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        a.REQUEST_ID: op.request_id,
        a.CHUNKS: len(op.chunk_hashes),
        a.TOKENS: op.end_token - op.start_token,
        a.BLOCKS: len(op.block_ids),
        a.RANGE_START: op.start_token,
        a.RANGE_END: op.end_token,
    }
    if isinstance(op, RetrieveOp):
        attributes[a.SKIP_FIRST_N_TOKENS] = op.skip_first_n_tokens
    return attributes


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
