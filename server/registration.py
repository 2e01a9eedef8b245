"""Worker registration: whether this server can take a worker's KV layout, the copy engine of
a worker that has the server do its copies, and whether a registered worker may begin an
operation.

Runs in the cache server process, for :class:`server.transfers.Transfers`. A registration is
refused (``invalid``, ``limit`` or ``conflict``) when the layout does not fit the server's
chunk size or minimum object size, when another worker registered the same model and world
size with other object sizes, or when the pool cannot serve the transfers asked for.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from server import quotas
from server.context import Call, ServiceError, Shared
from server.pools import MemoryPool
from server.state import ClientState, Worker
from testbed.core import protocol as p


def object_bytes(s: Shared, req: p.RegisterWorker, others: Iterable[ClientState]) -> int:
    """The size of the worker's objects (a chunk of its layout), or the refusal of its
    registration; ``others``: the other clients."""
    if req.kv_rank >= req.world_size:
        raise ServiceError("invalid", f"kv_rank {req.kv_rank} >= world_size {req.world_size}")
    chunk_size = s.config.chunk_size
    if chunk_size % req.layout.block_size:
        raise ServiceError(
            "invalid",
            f"the server's chunk size {chunk_size} is not a multiple of the worker's block "
            f"size {req.layout.block_size}; restart the server with a chunk size that is",
        )
    nbytes = chunk_size * req.layout.bytes_per_token
    if nbytes < s.config.min_object_bytes:
        raise s.limit(
            "min_object_bytes",
            s.config.min_object_bytes,
            f"bytes per object minimum (this layout makes {nbytes}-byte objects: raise "
            "the chunk size)",
        )
    for other in others:
        worker = other.worker
        if worker is None:
            continue
        same_space = (worker.request.model, worker.request.world_size) == (
            req.model,
            req.world_size,
        )
        if same_space and worker.object_bytes != nbytes:
            raise ServiceError(
                "conflict",
                f"model {req.model!r} world size {req.world_size} is already registered "
                f"with {worker.object_bytes} bytes per chunk, not {nbytes}",
            )
    return nbytes


def open_engine(pool: MemoryPool | None, req: p.RegisterWorker) -> tuple[Any, Any]:
    """Server-driven: the worker's KV mapped here and the pool as its engine copies to and
    from it; ``(None, None)`` when the worker copies itself. Refuses what this pool cannot
    serve."""
    if req.cuda_kv is None and req.shared_kv is None:
        if pool is not None and pool.path is None:
            raise ServiceError(
                "invalid",
                f"this server's pool is {pool.medium} memory, which workers cannot map: register "
                "CUDA KV for the server to copy (transfer_mode server), or use a server with "
                "--pool shm, disk or pinned-host",
            )
        return None, None
    if pool is None:
        raise ServiceError("invalid", "server-driven transfers need a pool (not --metadata-only)")
    if req.cuda_kv is not None:
        if pool.tensor is None:
            raise ServiceError(
                "invalid",
                "CUDA KV needs a pool the server's GPU copies reach: start the server with "
                f"--pool pinned-host or --pool gpu (this one has --pool {pool.medium})",
            )
        from server.cuda_engine import CudaEngineKV

        try:
            return CudaEngineKV(req.cuda_kv), pool.tensor
        except (RuntimeError, ValueError) as exc:
            raise ServiceError("invalid", f"cannot open the worker's CUDA KV: {exc}") from None
    assert req.shared_kv is not None
    if pool.array is None:
        raise ServiceError(
            "invalid", f"a {pool.medium} pool is not host memory: shared-memory KV cannot use it"
        )
    from server.kv_copier import EngineKV

    try:
        return EngineKV(req.shared_kv), pool.array
    except (OSError, ValueError) as exc:
        raise ServiceError("invalid", f"cannot map the worker's shared KV: {exc}") from None


def worker_for(s: Shared, call: Call, req: p.StoreBegin | p.RetrieveBegin) -> Worker:
    """The caller's registered worker, if it may begin the operation ``req`` now (its epoch,
    a new ``op_id``, within its quota and the server's limit of chunks per request)."""
    worker = call.client.worker
    if worker is None:
        raise ServiceError(
            "not_registered",
            "this client has not registered a KV layout (send register_worker first)",
        )
    if req.epoch != s.epoch:
        raise ServiceError(
            "stale_epoch",
            f"operation planned for server instance {req.epoch}, this is {s.epoch} (the "
            "server restarted): register again and map the new pool",
        )
    if req.op_id in call.client.op_ids():
        raise ServiceError(
            "conflict", f"operation {req.op_id} is already in flight for this client"
        )
    quotas.check_ops(s, call.client)
    s.check_chunks(sum(len(item.chunk_hashes) for item in req.items))
    return worker
