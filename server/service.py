"""The cache service: protocol requests in, replies out. No sockets (see ``server.app``).

Runs in the cache server process, single-threaded: every request is handled to completion
before the next, so the index needs no locking. Handlers raise :class:`ServiceError` for a
client's mistake; :meth:`CacheService.handle` turns it into an ``Error`` reply and the server
keeps serving. Every cache operation runs inside a SERVER span parented on the client's
propagated context; evictions and lock expiries get INTERNAL spans of their own.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from server.cache import CacheObject, Eviction, KVCache, ObjectKey, Released
from server.config import ServerConfig
from server.policies import make_policy
from server.pool import ExtentAllocator, SharedMemoryPool
from testbed import protocol as p
from testbed import telemetry
from testbed.telemetry import SpanKind
from testbed.telemetry import attributes as a

log = logging.getLogger(__name__)

SERVER_VERSION = "kvtestbed-server/1"


class ServiceError(Exception):
    def __init__(self, code: p.ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Worker:
    client: bytes
    request: p.RegisterWorker
    object_bytes: int

    def key(self, chunk_hash: bytes, cache_salt: str) -> ObjectKey:
        r = self.request
        return ObjectKey(r.model, r.world_size, r.kv_rank, chunk_hash, cache_salt)


@dataclass
class Session:
    session_id: str
    last_seen: float
    lookup_keys: list[tuple[ObjectKey, ...]] = field(default_factory=list)
    """Per chunk index of the last lookup's hit: the object keys of every KV rank."""
    objects: set[ObjectKey] = field(default_factory=set)
    """Objects the session looked up, stored or retrieved (refreshed on end)."""


@dataclass
class PendingLookup:
    client: bytes
    request: p.Lookup
    deadline: float
    polls: int = 0


@dataclass
class InflightStore:
    client: bytes
    objects: list[CacheObject]


@dataclass
class InflightRetrieve:
    client: bytes
    items: list[tuple[str, list[ObjectKey], list[bool]]]
    """Per item: session id, the chunk keys, and which of them were present (pinned)."""
    object_bytes: int


@dataclass
class Counters:
    evicted_objects: int = 0
    evicted_bytes: int = 0
    expired_locks: int = 0
    stored_bytes: int = 0
    retrieved_bytes: int = 0
    errors: int = 0


Handler = Callable[[bytes, p.Request, telemetry.Span], p.Reply]


class CacheService:
    """Context manager: owns the shared-memory pool (removed on close)."""

    def __init__(self, config: ServerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.pool = None if config.metadata_only else SharedMemoryPool(config.capacity_bytes)
        allocator = None if self.pool is None else ExtentAllocator(self.pool.size)
        self.cache = KVCache(
            config.capacity_bytes,
            make_policy(config.policy),
            allocator,
            clock,
            config.read_lock_ttl_s,
        )
        self.counters = Counters()
        self.workers: dict[bytes, Worker] = {}
        self.sessions: dict[str, Session] = {}
        self.pending: dict[str, PendingLookup] = {}
        self.stores: dict[int, InflightStore] = {}
        self.retrieves: dict[int, InflightRetrieve] = {}
        self.last_seen: dict[bytes, float] = {}
        self._next_id = 1
        self._handlers: dict[type, tuple[str | None, Handler]] = {
            p.Ping: (None, self._ping),
            p.Heartbeat: (None, self._ack),
            p.GetConfig: (None, self._get_config),
            p.GetStats: (None, self._get_stats),
            p.RegisterWorker: (a.SERVER_REGISTER, self._register),
            p.UnregisterWorker: (None, self._unregister),
            p.Lookup: (a.SERVER_LOOKUP, self._lookup),
            p.LookupPoll: (a.SERVER_LOOKUP, self._lookup_poll),
            p.FreeLocks: (a.SERVER_LOCK_RELEASE, self._free_locks),
            p.EndSession: (a.SERVER_END_SESSION, self._end_session),
            p.StoreBegin: (a.SERVER_STORE, self._store_begin),
            p.StoreCommit: (a.SERVER_STORE, self._store_commit),
            p.RetrieveBegin: (a.SERVER_RETRIEVE, self._retrieve_begin),
            p.RetrieveEnd: (a.SERVER_RETRIEVE, self._retrieve_end),
            p.DropObjects: (None, self._drop_objects),
        }

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    def __enter__(self) -> CacheService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -----------------------------------------------------------------------------------------
    # Entry points
    # -----------------------------------------------------------------------------------------

    def handle(self, client: bytes, request: p.Request) -> p.Reply:
        """The reply to one decoded request; never raises."""
        self.last_seen[client] = self.clock()
        if request.v != p.PROTOCOL_VERSION:
            return self.error(
                request.rid,
                "version",
                f"protocol version {request.v} is not supported; this server speaks "
                f"{p.PROTOCOL_VERSION} (upgrade the client or the server)",
            )
        span_name, handler = self._handlers[type(request)]
        try:
            if span_name is None:
                reply = handler(client, request, telemetry.INVALID_SPAN)
            else:
                with telemetry.traced(
                    span_name,
                    kind=SpanKind.SERVER,
                    parent=request.traceparent,
                    tracestate=request.tracestate,
                    attributes={a.OP: request.__struct_config__.tag},
                ) as span:
                    try:
                        reply = handler(client, request, span)
                    except ServiceError as exc:
                        telemetry.fail(span, f"{exc.code}: {exc}")
                        raise
        except ServiceError as exc:
            return self.error(request.rid, exc.code, str(exc))
        except Exception as exc:  # a bug must not take the server down
            log.exception("internal error handling %s", type(request).__name__)
            return self.error(request.rid, "internal", f"{type(exc).__name__}: {exc}")
        reply.rid = request.rid
        return reply

    def error(self, rid: int, code: p.ErrorCode, message: str) -> p.Error:
        self.counters.errors += 1
        return p.Error(rid=rid, code=code, message=message)

    def tick(self) -> None:
        """Applies TTLs and liveness: expired locks, idle sessions, silent clients."""
        for released in self.cache.expire_locks():
            self.counters.expired_locks += released.num_locks
            self._record_release(a.SERVER_LOCK_EXPIRE, "ttl", released)
        now = self.clock()
        for session_id in [
            s.session_id
            for s in self.sessions.values()
            if now - s.last_seen > self.config.session_ttl_s
        ]:
            self._drop_session(session_id)
        for session_id in [
            s for s, pl in self.pending.items() if now > pl.deadline + self.config.session_ttl_s
        ]:
            del self.pending[session_id]
        for client in [
            c for c, seen in self.last_seen.items() if now - seen > self.config.client_timeout_s
        ]:
            self.reap_client(client)

    def reap_client(self, client: bytes) -> None:
        """Forgets a client: its locks, in-flight stores and pins, and its registration."""
        log.warning("reaping silent client %r", client)
        for released in self.cache.unlock_client(client):
            self._record_release(a.SERVER_LOCK_EXPIRE, "client_timeout", released)
        for store_id in [i for i, s in self.stores.items() if s.client == client]:
            self._finish_store(store_id, ok=False)
        for retrieve_id in [i for i, r in self.retrieves.items() if r.client == client]:
            self._finish_retrieve(retrieve_id, ok=[])
        for session_id in [s for s, pl in self.pending.items() if pl.client == client]:
            del self.pending[session_id]
        self.workers.pop(client, None)
        self.last_seen.pop(client, None)

    # -----------------------------------------------------------------------------------------
    # Housekeeping requests
    # -----------------------------------------------------------------------------------------

    def _ping(self, client: bytes, req: p.Request, span: telemetry.Span) -> p.Reply:
        return p.Pong(server_version=SERVER_VERSION, pid=os.getpid())

    def _ack(self, client: bytes, req: p.Request, span: telemetry.Span) -> p.Reply:
        return p.Ack()

    def _get_config(self, client: bytes, req: p.Request, span: telemetry.Span) -> p.Reply:
        c = self.config
        return p.ServerConfigInfo(
            chunk_size=c.chunk_size,
            capacity_bytes=c.capacity_bytes,
            policy=c.policy,
            metadata_only=c.metadata_only,
            read_lock_ttl_s=c.read_lock_ttl_s,
            session_ttl_s=c.session_ttl_s,
        )

    def _get_stats(self, client: bytes, req: p.Request, span: telemetry.Span) -> p.Reply:
        c = self.counters
        return p.ServerStats(
            num_objects=len(self.cache),
            used_bytes=self.cache.used_bytes,
            capacity_bytes=self.cache.capacity_bytes,
            num_locks=self.cache.num_locks,
            num_pins=self.cache.num_pins,
            num_sessions=len(self.sessions),
            num_workers=len(self.workers),
            num_pending_lookups=len(self.pending),
            num_inflight_stores=len(self.stores),
            num_inflight_retrieves=len(self.retrieves),
            evicted_objects=c.evicted_objects,
            evicted_bytes=c.evicted_bytes,
            expired_locks=c.expired_locks,
            stored_bytes=c.stored_bytes,
            retrieved_bytes=c.retrieved_bytes,
            errors=c.errors,
        )

    def _register(self, client: bytes, req: p.Request, span: telemetry.Span) -> p.Reply:
        assert isinstance(req, p.RegisterWorker)
        if req.kv_rank >= req.world_size:
            raise ServiceError("invalid", f"kv_rank {req.kv_rank} >= world_size {req.world_size}")
        if self.config.chunk_size % req.layout.block_size:
            raise ServiceError(
                "invalid",
                f"the server's chunk size {self.config.chunk_size} is not a multiple of the "
                f"worker's block size {req.layout.block_size}; restart the server with a "
                f"chunk size that is",
            )
        object_bytes = self.config.chunk_size * req.layout.bytes_per_token
        for other in self.workers.values():
            same_space = (other.request.model, other.request.world_size) == (
                req.model,
                req.world_size,
            )
            if same_space and other.object_bytes != object_bytes:
                raise ServiceError(
                    "conflict",
                    f"model {req.model!r} world size {req.world_size} is already registered "
                    f"with {other.object_bytes} bytes per chunk, not {object_bytes}",
                )
        self.workers[client] = Worker(client, req, object_bytes)
        span.set_attributes(
            {a.MODEL: req.model, a.WORLD_SIZE: req.world_size, a.KV_RANK: req.kv_rank}
        )
        return p.WorkerRegistered(
            chunk_size=self.config.chunk_size,
            object_bytes=object_bytes,
            pool_path="" if self.pool is None else str(self.pool.path),
            pool_bytes=0 if self.pool is None else self.pool.size,
        )

    def _unregister(self, client: bytes, req: p.Request, span: telemetry.Span) -> p.Reply:
        for store_id in [i for i, s in self.stores.items() if s.client == client]:
            self._finish_store(store_id, ok=False)
        for retrieve_id in [i for i, r in self.retrieves.items() if r.client == client]:
            self._finish_retrieve(retrieve_id, ok=[])
        self.workers.pop(client, None)
        return p.Ack()

    # -----------------------------------------------------------------------------------------
    # Lookup, locks, sessions
    # -----------------------------------------------------------------------------------------

    def _lookup(self, client: bytes, req: p.Request, span: telemetry.Span) -> p.Reply:
        assert isinstance(req, p.Lookup)
        # A new lookup replaces the session's previous one (e.g. after a preemption).
        self.cache.unlock_session(req.session_id)
        self.pending.pop(req.session_id, None)
        deadline = self.clock() + self.config.lookup_pending_timeout_s
        return self._settle_lookup(PendingLookup(client, req, deadline), span)

    def _lookup_poll(self, client: bytes, req: p.Request, span: telemetry.Span) -> p.Reply:
        assert isinstance(req, p.LookupPoll)
        pending = self.pending.pop(req.session_id, None)
        if pending is None:
            raise ServiceError("unknown_id", f"no pending lookup for session {req.session_id!r}")
        pending.polls += 1
        return self._settle_lookup(pending, span)

    def _settle_lookup(self, pending: PendingLookup, span: telemetry.Span) -> p.LookupResult:
        req = pending.request
        hit, in_flight = self._hit_prefix(req)
        chunk_size = self.config.chunk_size
        span.set_attributes(
            {
                a.SESSION_ID: req.session_id,
                a.CHUNKS_REQUESTED: len(req.chunk_hashes),
                a.TOKENS_REQUESTED: len(req.chunk_hashes) * chunk_size,
                a.NUM_READERS: req.num_readers,
                a.LOOKUP_POLLS: pending.polls,
            }
        )
        if in_flight and self.clock() < pending.deadline:
            self.pending[req.session_id] = pending
            span.set_attribute(a.LOOKUP_PENDING, True)
            return p.LookupResult(pending=True)
        session = self._session(req.session_id)
        session.lookup_keys = []
        num_locks = 0
        for chunk_hash in req.chunk_hashes[:hit]:
            keys = tuple(
                ObjectKey(req.model, req.world_size, rank, chunk_hash, req.cache_salt)
                for rank in range(req.world_size)
            )
            for key in keys:
                self.cache.lock(req.session_id, pending.client, key, req.num_readers)
                self.cache.touch(key)
                num_locks += req.num_readers
            session.lookup_keys.append(keys)
            session.objects.update(keys)
        span.set_attributes(
            {
                a.LOOKUP_PENDING: False,
                a.CHUNKS_HIT: hit,
                a.TOKENS_HIT: hit * chunk_size,
                a.LOCKS_TAKEN: num_locks,
            }
        )
        return p.LookupResult(hit_chunks=hit, num_locks=num_locks)

    def _hit_prefix(self, req: p.Lookup) -> tuple[int, bool]:
        """Chunks stored on every rank, and whether the next chunk's store is in flight."""
        for index, chunk_hash in enumerate(req.chunk_hashes):
            objects = [
                self.cache.get(
                    ObjectKey(req.model, req.world_size, rank, chunk_hash, req.cache_salt)
                )
                for rank in range(req.world_size)
            ]
            if all(obj is not None and obj.committed for obj in objects):
                continue
            return index, all(obj is not None for obj in objects)
        return len(req.chunk_hashes), False

    def _free_locks(self, client: bytes, req: p.Request, span: telemetry.Span) -> p.Reply:
        assert isinstance(req, p.FreeLocks)
        session = self.sessions.get(req.session_id)
        chunk_size = self.config.chunk_size
        first = -(-req.start_token // chunk_size)  # first chunk starting at or after start
        last = req.end_token // chunk_size  # chunks ending at or before end
        num_chunks = num_locks = 0
        if session is not None:
            for chunk_keys in session.lookup_keys[first:last]:
                released = sum(self.cache.unlock(req.session_id, key) for key in chunk_keys)
                num_locks += released
                num_chunks += released > 0
        span.set_attributes(
            {
                a.SESSION_ID: req.session_id,
                a.RANGE_START: req.start_token,
                a.RANGE_END: req.end_token,
                a.CHUNKS: num_chunks,
                a.LOCKS_RELEASED: num_locks,
            }
        )
        return p.LocksFreed(num_chunks=num_chunks, num_locks=num_locks)

    def _end_session(self, client: bytes, req: p.Request, span: telemetry.Span) -> p.Reply:
        assert isinstance(req, p.EndSession)
        session = self.sessions.get(req.session_id)
        span.set_attributes(
            {
                a.SESSION_ID: req.session_id,
                a.CHUNKS: 0 if session is None else len(session.objects),
                a.LOCKS_RELEASED: 0,
            }
        )
        if session is not None:
            for key in session.objects:
                self.cache.touch(key)
        self._drop_session(req.session_id)
        return p.Ack()

    def _session(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            session = self.sessions[session_id] = Session(session_id, self.clock())
        session.last_seen = self.clock()
        return session

    def _drop_session(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)
        self.pending.pop(session_id, None)

    # -----------------------------------------------------------------------------------------
    # Store
    # -----------------------------------------------------------------------------------------

    def _worker(self, client: bytes) -> Worker:
        worker = self.workers.get(client)
        if worker is None:
            raise ServiceError(
                "not_registered",
                "this client has not registered a KV layout (send register_worker first)",
            )
        return worker

    def _store_begin(self, client: bytes, req: p.Request, span: telemetry.Span) -> p.Reply:
        assert isinstance(req, p.StoreBegin)
        worker = self._worker(client)
        eviction = Eviction(reason="capacity")
        objects: list[CacheObject] = []
        plans = []
        for item in req.items:
            plan = p.ItemSlots(slots=[])
            session = self._session(item.session_id)
            for chunk_hash in item.chunk_hashes:
                key = worker.key(chunk_hash, item.cache_salt)
                if self.cache.get(key) is not None:
                    plan.slots.append(None)
                    plan.num_present += 1
                    self.cache.touch(key)
                    continue
                obj = None
                if plan.num_full == 0:
                    obj = self.cache.reserve(key, worker.object_bytes, item.traceparent, eviction)
                if obj is None:
                    # Later chunks are unreachable without this one: do not store them either.
                    plan.slots.append(None)
                    plan.num_full += 1
                    continue
                objects.append(obj)
                session.objects.add(key)
                plan.slots.append(p.Slot(obj.offset or 0, obj.nbytes))
            plans.append(plan)
        self._record_eviction(eviction)
        store_id = self._new_id()
        self.stores[store_id] = InflightStore(client, objects)
        span.set_attributes(
            {
                a.NUM_REQUESTS: len(req.items),
                a.REQUEST_IDS: [item.session_id for item in req.items],
                a.KV_RANK: worker.request.kv_rank,
                a.CHUNKS_REQUESTED: sum(len(item.chunk_hashes) for item in req.items),
                a.CHUNKS_WRITTEN: len(objects),
                a.CHUNKS_PRESENT: sum(plan.num_present for plan in plans),
                a.CHUNKS_FULL: sum(plan.num_full for plan in plans),
                a.BYTES: len(objects) * worker.object_bytes,
                a.EVICTED_OBJECTS: len(eviction.keys),
                a.EVICTED_BYTES: eviction.nbytes,
                a.USED_BYTES: self.cache.used_bytes,
            }
        )
        return p.StorePlan(store_id=store_id, items=plans, evicted_objects=len(eviction.keys))

    def _store_commit(self, client: bytes, req: p.Request, span: telemetry.Span) -> p.Reply:
        assert isinstance(req, p.StoreCommit)
        store = self.stores.get(req.store_id)
        if store is None or store.client != client:
            raise ServiceError("unknown_id", f"no store {req.store_id} in flight for this client")
        committed = self._finish_store(req.store_id, req.ok)
        aborted = len(store.objects) - committed
        span.set_attributes(
            {
                a.OK: req.ok,
                a.CHUNKS_WRITTEN: committed,
                a.BYTES: sum(obj.nbytes for obj in store.objects) if req.ok else 0,
                a.USED_BYTES: self.cache.used_bytes,
            }
        )
        return p.StoreDone(num_committed=committed, num_aborted=aborted)

    def _finish_store(self, store_id: int, ok: bool) -> int:
        store = self.stores.pop(store_id)
        for obj in store.objects:
            if ok:
                self.cache.commit(obj)
                self.counters.stored_bytes += obj.nbytes
            else:
                self.cache.remove(obj)
        return len(store.objects) if ok else 0

    # -----------------------------------------------------------------------------------------
    # Retrieve
    # -----------------------------------------------------------------------------------------

    def _retrieve_begin(self, client: bytes, req: p.Request, span: telemetry.Span) -> p.Reply:
        assert isinstance(req, p.RetrieveBegin)
        worker = self._worker(client)
        items = []
        plans = []
        for item in req.items:
            keys = [worker.key(h, item.cache_salt) for h in item.chunk_hashes]
            present = []
            plan = p.ItemSlots(slots=[])
            for key in keys:
                obj = self.cache.committed(key)
                present.append(obj is not None)
                if obj is None:
                    plan.slots.append(None)
                    continue
                self.cache.pin(obj)
                plan.num_present += 1
                plan.slots.append(p.Slot(obj.offset or 0, obj.nbytes))
            self._session(item.session_id).objects.update(keys)
            items.append((item.session_id, keys, present))
            plans.append(plan)
        retrieve_id = self._new_id()
        self.retrieves[retrieve_id] = InflightRetrieve(client, items, worker.object_bytes)
        num_present = sum(plan.num_present for plan in plans)
        num_chunks = sum(len(keys) for _, keys, _ in items)
        span.set_attributes(
            {
                a.NUM_REQUESTS: len(req.items),
                a.REQUEST_IDS: [item.session_id for item in req.items],
                a.KV_RANK: worker.request.kv_rank,
                a.CHUNKS_REQUESTED: num_chunks,
                a.CHUNKS_MISSING: num_chunks - num_present,
                a.BYTES: num_present * worker.object_bytes,
            }
        )
        return p.RetrievePlan(retrieve_id=retrieve_id, items=plans)

    def _retrieve_end(self, client: bytes, req: p.Request, span: telemetry.Span) -> p.Reply:
        assert isinstance(req, p.RetrieveEnd)
        retrieve = self.retrieves.get(req.retrieve_id)
        if retrieve is None or retrieve.client != client:
            raise ServiceError(
                "unknown_id", f"no retrieve {req.retrieve_id} in flight for this client"
            )
        released = self._finish_retrieve(req.retrieve_id, req.ok)
        num_ok = sum(req.ok)
        span.set_attributes(
            {
                a.NUM_REQUESTS: len(retrieve.items),
                a.OK: num_ok == len(retrieve.items),
                a.LOCKS_RELEASED: released,
            }
        )
        return p.RetrieveDone(num_locks_released=released)

    def _finish_retrieve(self, retrieve_id: int, ok: list[bool]) -> int:
        """Unpins, releases one read lock per chunk and reader; ``ok`` per item (may be short)."""
        retrieve = self.retrieves.pop(retrieve_id)
        released = 0
        for index, (session_id, keys, present) in enumerate(retrieve.items):
            item_ok = index < len(ok) and ok[index]
            for key, was_present in zip(keys, present, strict=True):
                if was_present:
                    self.cache.unpin(key)
                    if item_ok:
                        self.cache.touch(key)
                        self.counters.retrieved_bytes += retrieve.object_bytes
                released += self.cache.unlock(session_id, key, 1)
        return released

    def _drop_objects(self, client: bytes, req: p.Request, span: telemetry.Span) -> p.Reply:
        assert isinstance(req, p.DropObjects)
        if req.chunk_hashes:
            keys = [k for h in req.chunk_hashes for k in self.cache.keys_with_hash(h)]
        else:
            keys = [obj.key for obj in self.cache.objects()]
        eviction = Eviction(reason="drop")
        released = 0
        for key in keys:
            obj = self.cache.get(key)
            if obj is None or not obj.committed or obj.pins or (obj.locks and not req.force):
                continue
            released += self.cache.drop(obj, eviction)
        self._record_eviction(eviction)
        return p.Dropped(
            num_objects=len(eviction.keys), num_bytes=eviction.nbytes, num_locks_released=released
        )

    # -----------------------------------------------------------------------------------------
    # Internal spans
    # -----------------------------------------------------------------------------------------

    def _record_eviction(self, eviction: Eviction) -> None:
        if not eviction.keys:
            return
        if eviction.reason == "capacity":
            self.counters.evicted_objects += len(eviction.keys)
            self.counters.evicted_bytes += eviction.nbytes
        with telemetry.traced(
            a.SERVER_EVICT,
            links=eviction.origins[:_MAX_LINKS],
            attributes={
                a.EVICTED_OBJECTS: len(eviction.keys),
                a.EVICTED_BYTES: eviction.nbytes,
                a.EVICT_REASON: eviction.reason,
                a.POLICY: self.config.policy,
                a.USED_BYTES: self.cache.used_bytes,
                a.CAPACITY_BYTES: self.cache.capacity_bytes,
            },
        ):
            pass

    def _record_release(self, span_name: str, reason: str, released: Released) -> None:
        with telemetry.traced(
            span_name,
            attributes={
                a.SESSION_ID: released.session_id,
                a.CHUNKS: len(released.keys),
                a.LOCKS_RELEASED: released.num_locks,
                a.HELD_MS: released.held_s * 1e3,
                a.EVICT_REASON: reason,
            },
        ):
            pass

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id


_MAX_LINKS = 64
