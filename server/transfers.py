"""Worker-side requests: registration, store, retrieve, abort.

Runs in the cache server process. :class:`Transfers` owns the operations in flight (each
client's stores and retrieves, on its ``ClientState``) and the workers' registrations; its
handlers take their own request types (routed by ``server.service``). A store or retrieve is
named by its client's ``op_id`` and belongs to that client: only it can commit, end or abort
it, and its deadline (``op_ttl_s``) expires it if the client never does.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TypeVar

from server import copies, registration
from server.context import Call, ServiceError, Shared, Steps
from server.objects import CacheObject, Eviction, ObjectKey, Space
from server.sessions import Sessions
from server.state import (
    ChunkRun,
    ClientState,
    Deadline,
    InflightRetrieve,
    InflightStore,
    Worker,
)
from testbed.core import protocol as p
from testbed.core import telemetry
from testbed.core.chunk_events import ABORT, COMMIT, RESERVE, TOUCH, namespace
from testbed.core.keys import ChunkHash
from testbed.core.telemetry import attributes as a

Op = TypeVar("Op", InflightStore, InflightRetrieve)


class Transfers:
    """The workers' operations; commits refresh the storing sessions (``sessions``)."""

    def __init__(self, shared: Shared, sessions: Sessions) -> None:
        self.s = shared
        self.sessions = sessions

    # -----------------------------------------------------------------------------------------
    # Registration
    # -----------------------------------------------------------------------------------------

    def register(self, call: Call, req: p.RegisterWorker) -> p.Reply:
        s = self.s
        others = (c for c in s.clients.values() if c is not call.client)
        object_bytes = registration.object_bytes(s, req, others)
        engine, pool_buffer = registration.open_engine(s.pool, req)
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
            chunk_size=s.config.chunk_size,
            object_bytes=object_bytes,
            pool_path="" if s.pool is None or s.pool.path is None else str(s.pool.path),
            pool_bytes=0 if s.pool is None else s.pool.size,
        )

    def unregister(self, call: Call, req: p.UnregisterWorker) -> p.Reply:
        self.drop_client(call.client)
        return p.Ack()

    def drop_client(self, client: ClientState) -> int:
        """Aborts the client's operations and closes its registration; returns how many
        operations it had in flight."""
        ops = len(client.stores) + len(client.retrieves)
        for op_id in list(client.stores):
            self.finish_store(client, op_id, ok=False)
        for op_id in list(client.retrieves):
            self.finish_retrieve(client, op_id, ok=[])
        if client.worker is not None:
            client.worker.close()
        client.worker = None
        return ops

    # -----------------------------------------------------------------------------------------
    # Store
    # -----------------------------------------------------------------------------------------

    def store_begin(self, call: Call, req: p.StoreBegin) -> Steps:
        s = self.s
        worker = registration.worker_for(self.s, call, req)
        yield from self.sessions.order.after_lookups(s, call.client, req)
        eviction = Eviction(reason="capacity")
        objects: list[CacheObject] = []
        positions: list[tuple[str, int]] = []
        plans = []
        for item in req.items:
            plan = p.ItemSlots(slots=[])
            yield from self._reserve_item(call, worker, item, plan, eviction, objects, positions)
            plans.append(plan)
        s.record_eviction(eviction, call.traceparent)
        copied, done_event, done = False, None, None
        if worker.engine is not None and objects:
            per_chunk = self._blocks_per_chunk(worker)
            done_event, done = yield from copies.store(
                s.cache, call, worker, req, plans, objects, per_chunk
            )
            copied = True
        deadline = s.clock() + s.config.op_ttl_s
        session_ids = frozenset(item.session_id for item in req.items)
        call.client.stores[req.op_id] = InflightStore(
            req.op_id, objects, positions, deadline, call.span_id, session_ids, done
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

    def _reserve_item(
        self,
        call: Call,
        worker: Worker,
        item: p.OpItem,
        plan: p.ItemSlots,
        eviction: Eviction,
        objects: list[CacheObject],
        positions: list[tuple[str, int]],
    ) -> Generator[None, None, None]:
        """Plans one item's chunks into ``plan``: present ones refreshed, absent ones reserved
        (into ``objects`` and ``positions``) until one does not fit."""
        cache, log = self.s.cache, self.s.chunk_log
        space = namespace(worker.request.model, worker.request.world_size, item.cache_salt)
        for index, chunk_hash in enumerate(item.chunk_hashes):
            position = item.first_chunk + index
            key = worker.key(chunk_hash, item.cache_salt)
            obj, event, cause = None, None, ""
            if cache.get(key) is not None:
                plan.slots.append(None)
                plan.num_present += 1
                cache.touch(key)
                event, cause = TOUCH, "store"
            else:
                if plan.num_full == 0:
                    obj = cache.reserve(
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
                    event = RESERVE
            if log.enabled and event is not None:
                log.add(
                    event,
                    chunk_hash,
                    kv_rank=key.kv_rank,
                    namespace=space,
                    session_id=item.session_id,
                    position=position,
                    cause=cause,
                    span_id=call.span_id,
                    nbytes=0 if obj is None else obj.nbytes,
                )
            if call.spend():
                yield

    def store_commit(self, call: Call, req: p.StoreCommit) -> p.Reply:
        store = self._inflight(call.client.stores, req.op_id, "store", "")
        committed = self.finish_store(call.client, req.op_id, req.ok, call.span_id)
        call.span.set_attributes(
            {
                a.OP_ID: req.op_id,
                a.OK: req.ok,
                a.CHUNKS_WRITTEN: committed,
                a.BYTES: sum(obj.nbytes for obj in store.objects) if req.ok else 0,
                a.USED_BYTES: self.s.cache.used_bytes,
            }
        )
        return p.StoreDone(
            num_committed=committed,
            num_aborted=len(store.objects) - committed,
            eviction_seq=self.s.evictions.seq,
        )

    def finish_store(self, client: ClientState, op_id: int, ok: bool, span_id: str = "") -> int:
        """Commits (``ok``) or drops the reservations of a store; returns the objects committed.
        Asynchronous copies into its slots are settled first."""
        s = self.s
        store = client.stores.pop(op_id)
        if store.done is not None:
            store.done.synchronize()
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
            if s.chunk_log.enabled:
                s.chunk_log.add_object(
                    COMMIT if ok else ABORT,
                    key,
                    session_id=session_id,
                    position=position,
                    span_id=span_id or store.span_id,
                    nbytes=obj.nbytes,
                )
        if ok and store.objects:
            s.evictions.committed(obj.key for obj in store.objects)
            s.tiers.stored(store.objects, store.objects[0].origin)
        for (session_id, space, rank), hashes in refresh.items():
            session = self.sessions.live.get(session_id)
            if session is not None:  # the request's end will refresh what it stored
                self.sessions.track(session, ChunkRun(space, hashes, (rank,)), lookup=False)
        return len(store.objects) if ok else 0

    # -----------------------------------------------------------------------------------------
    # Retrieve
    # -----------------------------------------------------------------------------------------

    def retrieve_begin(self, call: Call, req: p.RetrieveBegin) -> Steps:
        s = self.s
        worker = registration.worker_for(self.s, call, req)
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
            return (yield from self._server_retrieve(call, worker, req, plans))
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

    def _server_retrieve(
        self, call: Call, worker: Worker, req: p.RetrieveBegin, plans: list[p.ItemSlots]
    ) -> Steps:
        """Server-driven (``server.copies``). CPU copies are done when it returns, so the
        retrieve ends as ``RetrieveEnd`` would: unpinned, the items' lock units released. CUDA
        copies complete with the plan's done event: the pins hold until the worker's
        ``RetrieveEnd`` (or the deadline)."""
        per_chunk = self._blocks_per_chunk(worker)
        try:
            oks, (done_event, done) = yield from copies.retrieve(
                call, worker, req, plans, per_chunk
            )
        except ServiceError:
            self.finish_retrieve(call.client, req.op_id, [], call.span_id)
            raise
        if done is not None:
            retrieve = call.client.retrieves[req.op_id]
            retrieve.done = done
            self.s.deadlines.add(retrieve.deadline, "retrieve", call.client.client_id, req.op_id)
            return p.RetrievePlan(op_id=req.op_id, items=plans, copied=True, done_event=done_event)
        released = self.finish_retrieve(call.client, req.op_id, oks, call.span_id)
        call.span.set_attribute(a.LOCKS_RELEASED, released)
        return p.RetrievePlan(
            op_id=req.op_id, items=plans, copied=True, num_locks_released=released
        )

    def retrieve_end(self, call: Call, req: p.RetrieveEnd) -> p.Reply:
        retrieve = self._inflight(
            call.client.retrieves, req.op_id, "retrieve", ": its copy is not trustworthy"
        )
        released = self.finish_retrieve(call.client, req.op_id, req.ok, call.span_id)
        call.span.set_attributes(
            {
                a.OP_ID: req.op_id,
                a.NUM_REQUESTS: len(retrieve.items),
                a.OK: sum(req.ok) == len(retrieve.items),
                a.LOCKS_RELEASED: released,
            }
        )
        return p.RetrieveDone(num_locks_released=released)

    def finish_retrieve(
        self, client: ClientState, op_id: int, ok: list[bool], span_id: str = ""
    ) -> int:
        """Unpins a retrieve's objects and releases one lock unit per chunk of each item's lock
        group (whatever ``ok`` says: per item, may be short); returns the units released.
        Asynchronous copies out of its slots are settled before they are unpinned."""
        s = self.s
        retrieve = client.retrieves.pop(op_id)
        if retrieve.done is not None:
            retrieve.done.synchronize()
        released = 0
        for index, (session_id, handle, keys, present) in enumerate(retrieve.items):
            item_ok = index < len(ok) and ok[index]
            for key, was_present in zip(keys, present, strict=True):
                if not was_present:
                    continue
                s.cache.unpin(key)
                if item_ok:
                    s.cache.touch(key)
                    s.counters.retrieved_bytes += retrieve.object_bytes
                    if s.chunk_log.enabled:
                        s.chunk_log.add_object(
                            TOUCH,
                            key,
                            session_id=session_id,
                            cause="retrieve",
                            span_id=span_id,
                        )
            group = s.cache.groups.get(handle) if handle else None
            if group is not None and group.session_id == session_id:
                released += s.cache.release_reader(group, keys)
        return released

    # -----------------------------------------------------------------------------------------
    # Abort, deadlines and administration
    # -----------------------------------------------------------------------------------------

    def abort(self, call: Call, req: p.Abort) -> p.Reply:
        client = call.client
        aborted = 0
        for op_id in req.op_ids:
            if op_id in client.stores:
                self.finish_store(client, op_id, ok=False, span_id=call.span_id)
                aborted += 1
            elif op_id in client.retrieves:
                self.finish_retrieve(client, op_id, ok=[], span_id=call.span_id)
                aborted += 1
        self.s.counters.aborted_ops += aborted
        call.span.set_attributes({a.OPS: len(req.op_ids), a.CHUNKS: aborted})
        return p.Aborted(num_aborted=aborted)

    def expire(self, kind: str, owner: bytes, ident: object, now: float) -> None:
        """The deadline of client ``owner``'s operation ``ident`` (a ``store`` or a
        ``retrieve``) came: drops it if it passed."""
        s = self.s
        assert isinstance(ident, int)
        client = s.clients.get(owner)
        if client is None:
            return
        op = (client.stores if kind == "store" else client.retrieves).get(ident)
        if op is None or op.deadline > now:
            return
        s.counters.expired_ops += 1
        with telemetry.traced(
            a.SERVER_OP_EXPIRE, attributes={a.OP: kind, a.OP_ID: ident, a.CLIENT: owner.hex()}
        ):
            if kind == "store":
                self.finish_store(client, ident, ok=False)
            else:
                self.finish_retrieve(client, ident, ok=[])

    def live_deadlines(self) -> list[Deadline]:
        live: list[Deadline] = []
        for client in self.s.clients.values():
            live += [(op.deadline, "store", client.client_id, i) for i, op in client.stores.items()]
            live += [
                (op.deadline, "retrieve", client.client_id, i) for i, op in client.retrieves.items()
            ]
        return live

    # -----------------------------------------------------------------------------------------
    # Internal
    # -----------------------------------------------------------------------------------------

    def _inflight(self, ops: dict[int, Op], op_id: int, kind: str, consequence: str) -> Op:
        """The client's operation ``op_id`` of ``ops``; ``unknown_id`` if there is none."""
        op = ops.get(op_id)
        if op is None:
            raise ServiceError(
                "unknown_id",
                f"no {kind} {op_id} in flight for this client (never begun, aborted, or "
                f"expired after op_ttl_s={self.s.config.op_ttl_s:g}s){consequence}",
            )
        return op

    def _blocks_per_chunk(self, worker: Worker) -> int:
        return self.s.config.chunk_size // worker.request.layout.block_size
