"""Worker-side requests: registration, store, retrieve, abort; and the admin drop.

Handlers of :class:`server.service.CacheService` (generators; see there). A store or
retrieve is named by its client's ``op_id`` and belongs to that client: only it can commit,
end or abort it, and its deadline (``op_ttl_s``) expires it if the client never does.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

from server import quotas
from server.cache import CacheObject, Eviction, ObjectKey, Space
from server.chunk_log import ABORT, COMMIT, RESERVE, TOUCH, namespace
from server.state import ChunkRun, ClientState, InflightRetrieve, InflightStore, Worker
from testbed.core import protocol as p
from testbed.core.keys import ChunkHash
from testbed.core.telemetry import attributes as a

if TYPE_CHECKING:
    from server.context import Call, Service


def _error(code: p.ErrorCode, message: str) -> Exception:
    from server.context import ServiceError

    return ServiceError(code, message)


def register(s: Service, call: Call, req: p.Request) -> Generator[None, None, p.Reply]:
    assert isinstance(req, p.RegisterWorker)
    if req.kv_rank >= req.world_size:
        raise _error("invalid", f"kv_rank {req.kv_rank} >= world_size {req.world_size}")
    chunk_size = s.config.chunk_size
    if chunk_size % req.layout.block_size:
        raise _error(
            "invalid",
            f"the server's chunk size {chunk_size} is not a multiple of the worker's block "
            f"size {req.layout.block_size}; restart the server with a chunk size that is",
        )
    object_bytes = chunk_size * req.layout.bytes_per_token
    if object_bytes < s.config.min_object_bytes:
        raise s.limit(
            "min_object_bytes",
            s.config.min_object_bytes,
            f"bytes per object minimum (this layout makes {object_bytes}-byte objects: raise "
            "the chunk size)",
        )
    for other in s.clients.values():
        worker = other.worker
        if worker is None or other is call.client:
            continue
        same_space = (worker.request.model, worker.request.world_size) == (
            req.model,
            req.world_size,
        )
        if same_space and worker.object_bytes != object_bytes:
            raise _error(
                "conflict",
                f"model {req.model!r} world size {req.world_size} is already registered "
                f"with {worker.object_bytes} bytes per chunk, not {object_bytes}",
            )
    engine, pool_buffer = _open_engine(s, req)
    if call.client.worker is not None:
        call.client.worker.close()
    call.client.worker = Worker(req, object_bytes, engine, pool_buffer)
    call.span.set_attributes(
        {
            a.MODEL: req.model,
            a.WORLD_SIZE: req.world_size,
            a.KV_RANK: req.kv_rank,
            a.TRANSFER_MODE: "server" if engine is not None else "worker",
        }
    )
    return p.WorkerRegistered(
        chunk_size=chunk_size,
        object_bytes=object_bytes,
        pool_path="" if s.pool is None or s.pool.path is None else str(s.pool.path),
        pool_bytes=0 if s.pool is None else s.pool.size,
    )
    yield


def _open_engine(s: Service, req: p.RegisterWorker) -> tuple[Any, Any]:
    """Server-driven: the worker's KV mapped here and the pool as its engine copies to and
    from it; ``(None, None)`` when the worker copies itself. Refuses what this pool cannot
    serve."""
    pool = s.pool
    if req.cuda_kv is None and req.shared_kv is None:
        if pool is not None and pool.path is None:
            raise _error(
                "invalid",
                f"this server's pool is {pool.medium} memory, which workers cannot map: register "
                "CUDA KV for the server to copy (transfer_mode server), or use a server with "
                "--pool shm, disk or pinned-host",
            )
        return None, None
    if pool is None:
        raise _error("invalid", "server-driven transfers need a pool (not --metadata-only)")
    if req.cuda_kv is not None:
        if pool.tensor is None:
            raise _error(
                "invalid",
                "CUDA KV needs a pool the server's GPU copies reach: start the server with "
                f"--pool pinned-host or --pool gpu (this one has --pool {pool.medium})",
            )
        from server.cuda_engine import CudaEngineKV

        try:
            return CudaEngineKV(req.cuda_kv), pool.tensor
        except (RuntimeError, ValueError) as exc:
            raise _error("invalid", f"cannot open the worker's CUDA KV: {exc}") from None
    assert req.shared_kv is not None
    if pool.array is None:
        raise _error(
            "invalid", f"a {pool.medium} pool is not host memory: shared-memory KV cannot use it"
        )
    from server.kv_copier import EngineKV

    try:
        return EngineKV(req.shared_kv), pool.array
    except (OSError, ValueError) as exc:
        raise _error("invalid", f"cannot map the worker's shared KV: {exc}") from None


def unregister(s: Service, call: Call, req: p.Request) -> Generator[None, None, p.Reply]:
    client = call.client
    for op_id in list(client.stores):
        finish_store(s, client, op_id, ok=False)
    for op_id in list(client.retrieves):
        finish_retrieve(s, client, op_id, ok=[])
    if client.worker is not None:
        client.worker.close()
    client.worker = None
    return p.Ack()
    yield


def _worker_op(s: Service, call: Call, req: p.StoreBegin | p.RetrieveBegin) -> Worker:
    worker = call.client.worker
    if worker is None:
        raise _error(
            "not_registered",
            "this client has not registered a KV layout (send register_worker first)",
        )
    if req.epoch != s.epoch:
        raise _error(
            "stale_epoch",
            f"operation planned for server instance {req.epoch}, this is {s.epoch} (the "
            "server restarted): register again and map the new pool",
        )
    if req.op_id in call.client.op_ids():
        raise _error("conflict", f"operation {req.op_id} is already in flight for this client")
    quotas.check_ops(s, call.client)
    s.check_chunks(sum(len(item.chunk_hashes) for item in req.items))
    return worker


# ---------------------------------------------------------------------------------------------
# Store
# ---------------------------------------------------------------------------------------------


def store_begin(s: Service, call: Call, req: p.Request) -> Generator[None, None, p.Reply]:
    assert isinstance(req, p.StoreBegin)
    worker = _worker_op(s, call, req)
    eviction = Eviction(reason="capacity")
    objects: list[CacheObject] = []
    positions: list[tuple[str, int]] = []
    plans = []
    log = s.chunk_log
    space = namespace(worker.request.model, worker.request.world_size, "")
    for item in req.items:
        plan = p.ItemSlots(slots=[])
        if log.enabled:
            space = namespace(worker.request.model, worker.request.world_size, item.cache_salt)
        for index, chunk_hash in enumerate(item.chunk_hashes):
            position = item.first_chunk + index
            key = worker.key(chunk_hash, item.cache_salt)
            if s.cache.get(key) is not None:
                plan.slots.append(None)
                plan.num_present += 1
                s.cache.touch(key)
                if log.enabled:
                    log.add(
                        TOUCH,
                        chunk_hash,
                        kv_rank=key.kv_rank,
                        namespace=space,
                        session_id=item.session_id,
                        position=position,
                        cause="store",
                        span_id=call.span_id,
                    )
            else:
                obj = None
                if plan.num_full == 0:
                    obj = s.cache.reserve(
                        key, worker.object_bytes, call.traceparent, item.session_id, eviction
                    )
                if obj is None:
                    # Later chunks are unreachable without this one: do not store them either.
                    plan.slots.append(None)
                    plan.num_full += 1
                else:
                    objects.append(obj)
                    positions.append((item.session_id, position))
                    plan.slots.append(p.Slot(obj.offset or 0, obj.nbytes))
                    if log.enabled:
                        log.add(
                            RESERVE,
                            chunk_hash,
                            kv_rank=key.kv_rank,
                            namespace=space,
                            session_id=item.session_id,
                            position=position,
                            span_id=call.span_id,
                            nbytes=obj.nbytes,
                        )
            if call.spend():
                yield
        plans.append(plan)
    s.record_eviction(eviction, call.traceparent)
    copied, done_event, done = False, None, None
    if worker.engine is not None and objects:
        copied, done_event, done = yield from _server_store_copy(
            s, call, worker, req, plans, objects
        )
    deadline = s.clock() + s.config.op_ttl_s
    call.client.stores[req.op_id] = InflightStore(
        req.op_id,
        objects,
        positions,
        deadline,
        call.span_id,
        frozenset(item.session_id for item in req.items),
        done,
    )
    s.deadlines.add(deadline, "store", call.client.client_id, req.op_id)
    call.span.set_attributes(
        {
            a.OP_ID: req.op_id,
            a.NUM_REQUESTS: len(req.items),
            a.SESSION_IDS: [item.session_id for item in req.items],
            a.KV_RANK: worker.request.kv_rank,
            a.CHUNKS_REQUESTED: sum(len(item.chunk_hashes) for item in req.items),
            a.CHUNKS_WRITTEN: len(objects),
            a.CHUNKS_PRESENT: sum(plan.num_present for plan in plans),
            a.CHUNKS_FULL: sum(plan.num_full for plan in plans),
            a.BYTES: len(objects) * worker.object_bytes,
            a.EVICTED_OBJECTS: len(eviction.objects),
            a.EVICTED_BYTES: eviction.nbytes,
            a.USED_BYTES: s.cache.used_bytes,
        }
    )
    return p.StorePlan(
        op_id=req.op_id,
        items=plans,
        evicted_objects=len(eviction.objects),
        copied=copied,
        done_event=done_event,
    )


def _server_store_copy(
    s: Service,
    call: Call,
    worker: Worker,
    req: p.StoreBegin,
    plans: list[p.ItemSlots],
    objects: list[CacheObject],
) -> Generator[None, None, tuple[bool, p.CudaEvent | None, Any]]:
    """Server-driven: copies the engine's blocks into the reserved slots, an item at a time
    (other clients are served in between), after the engine's ready event (CUDA); returns
    ``(True, done descriptor, done event)`` (both ``None`` for CPU copies, which are done). A
    failure drops the reservations once no copy can still write into them."""
    from testbed.core.block_copy import item_copies

    per_chunk = s.config.chunk_size // worker.request.layout.block_size
    started = time.perf_counter()
    engine = worker.engine
    try:
        engine.begin(req.ready_event)
        for item, plan in zip(req.items, plans, strict=True):
            if len(item.block_ids) < len(item.chunk_hashes) * per_chunk:
                raise ValueError(
                    f"item of {len(item.chunk_hashes)} chunks names {len(item.block_ids)} blocks"
                )
            copies, _ = item_copies(item.block_ids, plan.slots, per_chunk)
            if copies:
                engine.store(worker.pool_buffer, copies)
                if call.spend(len(copies) * per_chunk):
                    yield
        done_event, done = engine.end()
    except (ValueError, IndexError, OSError, RuntimeError) as exc:
        _settle_after_failure(engine)
        for obj in objects:
            s.cache.remove(obj)
        raise _error("invalid", f"copying the engine's blocks failed: {exc}") from None
    call.span.set_attribute(a.COPY_MS, (time.perf_counter() - started) * 1e3)
    return True, done_event, done


def _settle_after_failure(engine: Any) -> None:
    """Waits for whatever copies an operation had issued before it failed (CUDA), so that
    no slot it frees is still being written or read."""
    try:
        _, done = engine.end()
    except (ValueError, RuntimeError):
        return
    if done is not None:
        done.synchronize()


def store_commit(s: Service, call: Call, req: p.Request) -> Generator[None, None, p.Reply]:
    assert isinstance(req, p.StoreCommit)
    store = call.client.stores.get(req.op_id)
    if store is None:
        raise _error(
            "unknown_id",
            f"no store {req.op_id} in flight for this client (never begun, aborted, or "
            f"expired after op_ttl_s={s.config.op_ttl_s:g}s)",
        )
    committed = finish_store(s, call.client, req.op_id, req.ok, call.span_id)
    call.span.set_attributes(
        {
            a.OP_ID: req.op_id,
            a.OK: req.ok,
            a.CHUNKS_WRITTEN: committed,
            a.BYTES: sum(obj.nbytes for obj in store.objects) if req.ok else 0,
            a.USED_BYTES: s.cache.used_bytes,
        }
    )
    return p.StoreDone(
        num_committed=committed,
        num_aborted=len(store.objects) - committed,
        eviction_seq=s.evictions.seq,
    )
    yield


def finish_store(s: Service, client: ClientState, op_id: int, ok: bool, span_id: str = "") -> int:
    """Commits (``ok``) or drops the reservations of a store; returns the objects committed.
    Asynchronous copies into its slots are settled first."""
    store = client.stores.pop(op_id)
    if store.done is not None:
        store.done.synchronize()
    log = s.chunk_log
    refresh: dict[tuple[str, Space, int], list[ChunkHash]] = {}
    for obj, (session_id, position) in zip(store.objects, store.positions, strict=True):
        key = obj.key
        if ok:
            s.cache.commit(obj)
            s.counters.stored_bytes += obj.nbytes
            space = Space(key.model, key.world_size, key.cache_salt)
            refresh.setdefault((session_id, space, key.kv_rank), []).append(key.chunk_hash)
        else:
            s.cache.remove(obj)
        if log.enabled:
            log.add(
                COMMIT if ok else ABORT,
                key.chunk_hash,
                kv_rank=key.kv_rank,
                namespace=namespace(key.model, key.world_size, key.cache_salt),
                session_id=session_id,
                position=position,
                span_id=span_id or store.span_id,
                nbytes=obj.nbytes,
            )
    for (session_id, space, rank), hashes in refresh.items():
        session = s.sessions.get(session_id)
        if session is not None:  # the request's end will refresh what it stored
            s.track(session, ChunkRun(space, hashes, (rank,)), lookup=False)
    return len(store.objects) if ok else 0


# ---------------------------------------------------------------------------------------------
# Retrieve
# ---------------------------------------------------------------------------------------------


def retrieve_begin(s: Service, call: Call, req: p.Request) -> Generator[None, None, p.Reply]:
    assert isinstance(req, p.RetrieveBegin)
    worker = _worker_op(s, call, req)
    items: list[tuple[str, bytes, list[ObjectKey], list[bool]]] = []
    plans = []
    for item in req.items:
        keys = [worker.key(h, item.cache_salt) for h in item.chunk_hashes]
        present = []
        plan = p.ItemSlots(slots=[])
        for key in keys:
            obj = s.cache.committed(key)
            present.append(obj is not None)
            if obj is None:
                plan.slots.append(None)
            else:
                s.cache.pin(obj)
                plan.num_present += 1
                plan.slots.append(p.Slot(obj.offset or 0, obj.nbytes))
            if call.spend():
                yield
        items.append((item.session_id, item.handle, keys, present))
        plans.append(plan)
    deadline = s.clock() + s.config.op_ttl_s
    call.client.retrieves[req.op_id] = InflightRetrieve(
        req.op_id, items, worker.object_bytes, deadline
    )
    if worker.engine is not None:
        return (yield from _server_retrieve_copy(s, call, worker, req, plans))
    s.deadlines.add(deadline, "retrieve", call.client.client_id, req.op_id)
    num_present = sum(plan.num_present for plan in plans)
    num_chunks = sum(len(keys) for _, _, keys, _ in items)
    call.span.set_attributes(
        {
            a.OP_ID: req.op_id,
            a.NUM_REQUESTS: len(req.items),
            a.SESSION_IDS: [item.session_id for item in req.items],
            a.KV_RANK: worker.request.kv_rank,
            a.CHUNKS_REQUESTED: num_chunks,
            a.CHUNKS_MISSING: num_chunks - num_present,
            a.BYTES: num_present * worker.object_bytes,
        }
    )
    return p.RetrievePlan(op_id=req.op_id, items=plans)


def _server_retrieve_copy(
    s: Service, call: Call, worker: Worker, req: p.RetrieveBegin, plans: list[p.ItemSlots]
) -> Generator[None, None, p.Reply]:
    """Server-driven: copies the pinned objects into the engine's blocks (never the first
    ``skip_blocks`` of an item), after the engine's ready event (CUDA). CPU copies are done
    here, so the retrieve ends as ``RetrieveEnd`` would: unpinned, the items' lock units
    released. CUDA copies complete with the plan's done event: the pins hold until the worker's
    ``RetrieveEnd`` (or the deadline). A failed item's chunks count as missing."""
    from testbed.core.block_copy import item_copies

    per_chunk = s.config.chunk_size // worker.request.layout.block_size
    engine = worker.engine
    try:
        engine.begin(req.ready_event)
    except (ValueError, RuntimeError) as exc:
        finish_retrieve(s, call.client, req.op_id, [], call.span_id)
        raise _error("invalid", f"cannot order the copies: {exc}") from None
    oks: list[bool] = []
    started = time.perf_counter()
    for item, plan in zip(req.items, plans, strict=True):
        copies, _ = item_copies(item.block_ids, plan.slots, per_chunk, item.skip_blocks)
        try:
            if copies:
                engine.retrieve(worker.pool_buffer, copies)
            oks.append(True)
        except (ValueError, IndexError, OSError, RuntimeError):
            plan.slots = [None] * len(plan.slots)  # nothing of it was loaded
            plan.num_present = 0
            oks.append(False)
        if call.spend(max(1, len(copies)) * per_chunk):
            yield
    done_event, done = engine.end()
    call.span.set_attribute(a.COPY_MS, (time.perf_counter() - started) * 1e3)
    if done is not None:
        retrieve = call.client.retrieves[req.op_id]
        retrieve.done = done
        s.deadlines.add(retrieve.deadline, "retrieve", call.client.client_id, req.op_id)
        return p.RetrievePlan(op_id=req.op_id, items=plans, copied=True, done_event=done_event)
    released = finish_retrieve(s, call.client, req.op_id, oks, call.span_id)
    call.span.set_attribute(a.LOCKS_RELEASED, released)
    return p.RetrievePlan(op_id=req.op_id, items=plans, copied=True, num_locks_released=released)


def retrieve_end(s: Service, call: Call, req: p.Request) -> Generator[None, None, p.Reply]:
    assert isinstance(req, p.RetrieveEnd)
    retrieve = call.client.retrieves.get(req.op_id)
    if retrieve is None:
        raise _error(
            "unknown_id",
            f"no retrieve {req.op_id} in flight for this client (never begun, aborted, or "
            f"expired after op_ttl_s={s.config.op_ttl_s:g}s): its copy is not trustworthy",
        )
    released = finish_retrieve(s, call.client, req.op_id, req.ok, call.span_id)
    call.span.set_attributes(
        {
            a.OP_ID: req.op_id,
            a.NUM_REQUESTS: len(retrieve.items),
            a.OK: sum(req.ok) == len(retrieve.items),
            a.LOCKS_RELEASED: released,
        }
    )
    return p.RetrieveDone(num_locks_released=released)
    yield


def finish_retrieve(
    s: Service, client: ClientState, op_id: int, ok: list[bool], span_id: str = ""
) -> int:
    """Unpins a retrieve's objects and releases one lock unit per chunk of each item's lock
    group (whatever ``ok`` says: per item, may be short); returns the units released.
    Asynchronous copies out of its slots are settled before they are unpinned."""
    retrieve = client.retrieves.pop(op_id)
    if retrieve.done is not None:
        retrieve.done.synchronize()
    released = 0
    log = s.chunk_log
    for index, (session_id, handle, keys, present) in enumerate(retrieve.items):
        item_ok = index < len(ok) and ok[index]
        for key, was_present in zip(keys, present, strict=True):
            if was_present:
                s.cache.unpin(key)
                if item_ok:
                    s.cache.touch(key)
                    s.counters.retrieved_bytes += retrieve.object_bytes
                    if log.enabled:
                        log.add(
                            TOUCH,
                            key.chunk_hash,
                            kv_rank=key.kv_rank,
                            namespace=namespace(key.model, key.world_size, key.cache_salt),
                            session_id=session_id,
                            cause="retrieve",
                            span_id=span_id,
                        )
        group = s.cache.groups.get(handle) if handle else None
        if group is not None and group.session_id == session_id:
            released += s.cache.release_reader(group, keys)
    return released


# ---------------------------------------------------------------------------------------------
# Abort and administration
# ---------------------------------------------------------------------------------------------


def abort(s: Service, call: Call, req: p.Request) -> Generator[None, None, p.Reply]:
    assert isinstance(req, p.Abort)
    client = call.client
    aborted = 0
    for op_id in req.op_ids:
        if op_id in client.stores:
            finish_store(s, client, op_id, ok=False, span_id=call.span_id)
            aborted += 1
        elif op_id in client.retrieves:
            finish_retrieve(s, client, op_id, ok=[], span_id=call.span_id)
            aborted += 1
    s.counters.aborted_ops += aborted
    call.span.set_attributes({a.OPS: len(req.op_ids), a.CHUNKS: aborted})
    return p.Aborted(num_aborted=aborted)
    yield


def drop_objects(s: Service, call: Call, req: p.Request) -> Generator[None, None, p.Reply]:
    assert isinstance(req, p.DropObjects)
    if req.chunk_hashes:
        keys = [k for h in req.chunk_hashes for k in s.cache.keys_with_hash(h)]
    else:
        keys = [obj.key for obj in s.cache.objects()]
    eviction = Eviction(reason="drop")
    released = 0
    for key in keys:
        obj = s.cache.get(key)
        if obj is None or not obj.committed or obj.pins or (obj.locks and not req.force):
            continue
        released += s.cache.drop(obj, eviction)
        if call.spend():
            yield
    s.record_eviction(eviction, req.traceparent)
    return p.Dropped(
        num_objects=len(eviction.objects), num_bytes=eviction.nbytes, num_locks_released=released
    )
