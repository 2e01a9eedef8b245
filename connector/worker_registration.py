"""A worker's registration with the cache server: identity, pool mapping, registering again.

Runs in each worker process (one per TP rank). Trust rules:

- the pool mapping always belongs to the server instance (epoch) the worker registered with:
  a reply of another epoch means the server restarted, and the worker registers again and maps
  the new pool before any copy; operations name their epoch, so the server refuses stale ones;
- a server that does not know the worker's registration (it restarted before the worker heard
  of it) answers with one of the :data:`REGISTER_AGAIN` error codes; the worker registers anew;
- an operation the worker gave up on (timeout, copy error) is aborted on the server by its
  ``op_id`` (:meth:`Registration.abort`), so no reservation or pin outlives the worker's
  interest.

Server-driven transfers (transfer mode ``server``): at registration the KV tensors move (in
place: vLLM keeps using them) into a file the server maps (:class:`SharedKV`, CPU KV), or are
exported through CUDA IPC (:class:`CudaExport`, whose events operations borrow). The store and
retrieve state machines (``worker_stores``, ``worker_retrieves``) share one registration.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from connector import worker_spans as spans
from connector.cuda_ipc import CudaExport
from connector.kv_copy import PagedKV, PoolMapping
from connector.ops import RetrieveOp, StoreOp
from connector.shared_kv import SharedKV
from connector.stats import StatsRecorder
from testbed.core import protocol as p
from testbed.core import telemetry
from testbed.core.ranks import WorkerIdentity, resolve_transfer_mode
from testbed.core.rpc import RemoteError, RpcClient, ServerUnavailable, check
from testbed.core.telemetry import SpanKind
from testbed.core.telemetry import attributes as a

log = logging.getLogger(__name__)

REGISTER_AGAIN: frozenset[p.ErrorCode] = frozenset({"not_registered", "stale_epoch"})
"""Error codes of a server that does not know this worker's registration: it restarted, and
the worker registers again before it retries."""


@dataclass(frozen=True)
class NoReply:
    """Why an operation got no reply it can use."""

    reason: str
    code: p.ErrorCode | None = None
    """The server's error code; ``None`` when no reply came (a timeout, a closed client)."""

    @property
    def register_again(self) -> bool:
        """The server does not know the registration (see :data:`REGISTER_AGAIN`)."""
        return self.code in REGISTER_AGAIN


def settled(future: Future[p.Reply]) -> p.Reply | NoReply:
    """The reply of a done ``future``, or why there is none."""
    try:
        return check(future.result(0))
    except RemoteError as exc:
        return NoReply(str(exc), exc.code)
    except Exception as exc:  # ServerUnavailable, or the client closing
        return NoReply(str(exc))


class Registration:
    """What a worker's operations need to know of the server instance it registered with:
    its epoch and chunk size, the mapped pool, the KV export of server-driven transfers."""

    def __init__(self, rpc: RpcClient, identity: WorkerIdentity, stats: StatsRecorder) -> None:
        self.rpc = rpc
        self.identity = identity
        self.stats = stats
        """Counts the aborts (abandoned releases) for vLLM's connector stats."""
        self.kv: PagedKV | None = None
        self.chunk_size = 0
        self.epoch = 0
        """The server instance this worker registered with (and whose pool it maps)."""
        self.pool: PoolMapping | None = None
        self.pool_path = ""
        self.shared: SharedKV | CudaExport | None = None
        """Server-driven transfers: the KV tensors moved into a file the server maps, or
        exported through CUDA IPC."""
        self.transfer_mode = identity.transfer_mode
        """The mode in use: ``identity.transfer_mode`` with ``auto`` resolved at registration."""

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
            shared = self.shared
            reply = self.rpc.call(
                p.RegisterWorker(
                    model=ident.model,
                    world_size=ident.world_size,
                    kv_rank=ident.kv_rank,
                    tp_size=ident.tp_size,
                    mla=ident.mla,
                    layout=kv.layout(),
                    shared_kv=shared.description if isinstance(shared, SharedKV) else None,
                    cuda_kv=shared.description if isinstance(shared, CudaExport) else None,
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
        replaced = self.pool is not None
        if replaced and reply.pool_path == self.pool_path and reply.epoch == self.epoch:
            return False
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        self.pool_path = reply.pool_path
        if reply.pool_path:
            self.pool = PoolMapping(reply.pool_path, reply.pool_bytes)
        if replaced:
            log.warning("the cache server restarted (epoch %d); mapped its new pool", reply.epoch)
        return replaced

    def stale(self) -> bool:
        """Whether the server answered with another epoch than the registration's."""
        return self.rpc.server_epoch not in (0, self.epoch)

    def ensure_current(self) -> None:
        """Registers again when the server's epoch changed since registration (a server that
        does not answer or refuses fails the operation that follows instead)."""
        if self.kv is not None and self.stale():
            with contextlib.suppress(ServerUnavailable, RemoteError):
                self.register(self.kv)

    def register_again(self) -> bool:
        """Registers anew (the server forgot this worker); False if it did not answer."""
        assert self.kv is not None
        try:
            self.register(self.kv)
        except (ServerUnavailable, RemoteError):
            return False
        return True

    @property
    def block_size(self) -> int:
        assert self.kv is not None, "register() first"
        return self.kv.block_size

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_size // self.block_size

    def loadable_blocks(self, op: RetrieveOp) -> list[int]:
        """The blocks a retrieve writes: past those the engine already holds."""
        return op.block_ids[op.skip_first_n_tokens // self.block_size :]

    def items(self, ops: Sequence[StoreOp] | Sequence[RetrieveOp]) -> list[p.OpItem]:
        """The ops as protocol items; server-driven, with the blocks the server copies."""
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
                skip_blocks=op.skip_first_n_tokens // self.block_size
                if with_blocks and isinstance(op, RetrieveOp)
                else 0,
                after_lookup=isinstance(op, StoreOp) and op.after_lookup,
            )
            for op in ops
        ]

    @property
    def cuda(self) -> CudaExport | None:
        """The CUDA IPC export (server-driven transfers of CUDA KV), if any."""
        return self.shared if isinstance(self.shared, CudaExport) else None

    def record_ready(self) -> tuple[int | None, p.CudaEvent | None]:
        """CUDA IPC: an event recorded now on the KV's stream, lent to one operation."""
        if self.cuda is None:
            return None, None
        return self.cuda.events.record()

    def release_ready(self, token: int | None) -> None:
        """CUDA IPC: the operation that borrowed the event ``token`` has ended."""
        if self.cuda is not None:
            self.cuda.events.release(token)

    def abort(self, op_id: int, op_span: telemetry.Span, reason: str) -> None:
        """Tells the server to drop an operation this worker gave up on (fire and forget),
        leaving a ``kvcache.connector.abort`` span under the operation's.

        Sent even when the server looks down: one that was only frozen or slow reads it when
        it resumes, after the request it aborts (one connection keeps their order), so its
        pins or reservation go at once; for one that is gone, its operation deadline cleans up.
        """
        self.stats.abandoned_release()
        with spans.aborting(op_id, op_span, reason):
            traceparent, tracestate = telemetry.inject()
            with contextlib.suppress(ServerUnavailable):
                self.rpc.fire(
                    p.Abort(op_ids=[op_id], traceparent=traceparent, tracestate=tracestate)
                )

    def close(self) -> None:
        """Leaves the server, unmaps its pool and ends the KV export."""
        if self.kv is not None and self.rpc.alive:
            with contextlib.suppress(ServerUnavailable, RemoteError):
                self.rpc.call(p.UnregisterWorker(), timeout_s=1.0)
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        if self.shared is not None:
            self.shared.close()
            self.shared = None
