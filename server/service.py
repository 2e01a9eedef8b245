"""The cache service: protocol requests in, replies out. No sockets (see ``server.app``).

Runs in the cache server process, single-threaded, so the index needs no locking. Contracts:

- **Authentication**: every request but ``ping`` must carry the client token (admin
  requests the admin token); anything else is refused before it touches any state.
- **Ownership**: a client connection owns the sessions it looked up, the lock groups its
  lookups took, and the reservations and pins of its operations; no other client can free,
  commit, poll or steal them (``forbidden``). A client's death (disconnect, or silence past
  ``client_timeout_s``) releases everything it owned.
- **Deadlines**: every reservation, pin, pending lookup, lock group and session expires
  (``op_ttl_s``, ``lookup_pending_timeout_s``, ``read_lock_ttl_s``, ``session_ttl_s``); the
  housekeeping :meth:`CacheService.tick` sweeps them, so nothing outlives its owner's
  interest. :meth:`CacheService.quiescence` tells what is still held.
- **Quotas**: besides the server-wide limits, each client has a share of sessions, tracked
  chunks, operations in flight and pending lookups (``server.quotas``); over it only that
  client is refused (code ``quota``).
- **Bounded work**: a request naming many chunks is handled in slices of
  :data:`SLICE_UNITS` chunk operations; other clients' requests are served between slices,
  and a client's own later requests wait behind it, so each client sees its requests handled
  in order. Handlers are generators that ``yield`` between slices.
- **Errors**: handlers raise :class:`ServiceError` for a client's mistake; any exception
  becomes an ``Error`` reply and the server keeps serving.

Every cache operation runs inside a SERVER span parented on the client's propagated context;
evictions, lock expiries and expired operations get INTERNAL spans of their own, and chunk
events go to the chunk log (``server.chunk_log``).
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass

from server import held, lookups, quotas, transfers
from server.auth import Credentials
from server.cache import Eviction, KVCache, Released
from server.chunk_log import NullChunkLog
from server.config import ServerConfig
from server.context import Call, ServiceError
from server.eviction_feed import EvictionFeed
from server.pool import ExtentAllocator
from server.pools import make_pool
from server.state import (
    CLIENT_INDEX_BYTES,
    SESSION_INDEX_BYTES,
    TRACKED_CHUNK_INDEX_BYTES,
    ChunkRun,
    ClientState,
    Counters,
    Deadlines,
    PendingLookup,
    Session,
)
from testbed.core import protocol as p
from testbed.core import telemetry
from testbed.core.policies import make_policy
from testbed.core.telemetry import SpanKind
from testbed.core.telemetry import attributes as a

log = logging.getLogger(__name__)

SERVER_VERSION = "kvtestbed-server/2"
"""Chunk operations one request may do before other clients are served (about 1-2 ms)."""
MAX_LINKS = 64

Handler = Callable[["CacheService", "Call", p.Request], Generator[None, None, p.Reply]]


@dataclass
class _Task:
    call: Call
    steps: Generator[None, None, p.Reply]


_SPANS: dict[type, str | None] = {
    p.Ping: None,
    p.Heartbeat: None,
    p.GetConfig: None,
    p.GetStats: None,
    p.RegisterWorker: a.SERVER_REGISTER,
    p.UnregisterWorker: None,
    p.Lookup: a.SERVER_LOOKUP,
    p.LookupPoll: a.SERVER_LOOKUP,
    p.FreeLocks: a.SERVER_LOCK_RELEASE,
    p.EndSession: a.SERVER_END_SESSION,
    p.StoreBegin: a.SERVER_STORE,
    p.StoreCommit: a.SERVER_STORE,
    p.RetrieveBegin: a.SERVER_RETRIEVE,
    p.RetrieveEnd: a.SERVER_RETRIEVE,
    p.Abort: a.SERVER_ABORT,
    p.DropObjects: None,
    p.GetHeld: None,
}


class CacheService:
    """Context manager: owns the memory pool (``server.pools``) and the chunk log (closed on
    exit)."""

    def __init__(
        self,
        config: ServerConfig,
        credentials: Credentials,
        *,
        clock: Callable[[], float] = time.monotonic,
        chunk_log: NullChunkLog | None = None,
    ) -> None:
        self.config = config
        self.credentials = credentials
        self.clock = clock
        self.epoch = secrets.randbits(62) + 1
        self.pool = (
            None
            if config.metadata_only
            else make_pool(
                config.pool_medium, config.capacity_bytes, config.pool_device, config.pool_dir
            )
        )
        allocator = None if self.pool is None else ExtentAllocator(self.pool.size)
        self.cache = KVCache(
            config.capacity_bytes,
            make_policy(config.policy),
            allocator,
            clock,
            config.read_lock_ttl_s,
        )
        self.chunk_log = chunk_log or NullChunkLog()
        self.evictions = EvictionFeed()
        """Removals of committed objects, for lookups that ask (vLLM's KV events)."""
        self.counters = Counters()
        self.clients: dict[bytes, ClientState] = {}
        self.sessions: dict[str, Session] = {}
        self.tracked_chunks = 0
        self.deadlines = Deadlines()
        self._running: dict[bytes, _Task] = {}
        self._queued: dict[bytes, deque[p.Request]] = {}
        self._handlers: dict[type, Handler] = {
            p.Ping: _ping,
            p.Heartbeat: _ack,
            p.GetConfig: _get_config,
            p.GetStats: _get_stats,
            p.RegisterWorker: transfers.register,
            p.UnregisterWorker: transfers.unregister,
            p.Lookup: lookups.lookup,
            p.LookupPoll: lookups.lookup_poll,
            p.FreeLocks: lookups.free_locks,
            p.EndSession: lookups.end_session,
            p.StoreBegin: transfers.store_begin,
            p.StoreCommit: transfers.store_commit,
            p.RetrieveBegin: transfers.retrieve_begin,
            p.RetrieveEnd: transfers.retrieve_end,
            p.Abort: transfers.abort,
            p.DropObjects: transfers.drop_objects,
            p.GetHeld: held.get_held,
        }

    def close(self) -> None:
        self.chunk_log.close()
        for client in self.clients.values():
            if client.worker is not None:
                client.worker.close()
        if self.pool is not None:
            self.pool.close()

    def __enter__(self) -> CacheService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -----------------------------------------------------------------------------------------
    # Entry points
    # -----------------------------------------------------------------------------------------

    def handle(self, client_id: bytes, request: p.Request | p.Batch) -> list[tuple[bytes, p.Reply]]:
        """Replies ready now for one decoded request (none if it waits behind the client's
        earlier request, or was split into slices: :meth:`advance` finishes it). A batch's
        requests are handled one by one, in order, as if each had come alone."""
        if isinstance(request, p.Batch):
            refusal = self._refusal(request)
            if refusal is not None:
                return [(client_id, self._refused(item, refusal)) for item in request.requests]
            return [reply for item in request.requests for reply in self.handle(client_id, item)]
        refusal = self._refusal(request)
        if refusal is not None:
            return [(client_id, refusal)]
        client = self.clients.get(client_id)
        if client is None:
            client = self.clients[client_id] = ClientState(client_id, self.clock())
        client.last_seen = self.clock()
        if client_id in self._running:
            self._queued.setdefault(client_id, deque()).append(request)
            return []
        return self._start(client, request)

    def advance(self) -> list[tuple[bytes, p.Reply]]:
        """Runs one slice of every request split into slices; the replies that completed."""
        replies: list[tuple[bytes, p.Reply]] = []
        for client_id, task in list(self._running.items()):
            reply = self._step(task)
            if reply is None:
                continue
            del self._running[client_id]
            replies.append((client_id, reply))
            queue = self._queued.get(client_id)
            while queue and client_id not in self._running:
                client = self.clients.get(client_id)
                request = queue.popleft()
                if client is None:
                    continue
                replies += self._start(client, request)
            if not queue:
                self._queued.pop(client_id, None)
        return replies

    @property
    def busy(self) -> bool:
        """Whether requests split into slices are waiting for :meth:`advance`."""
        return bool(self._running)

    def error(self, rid: int, code: p.ErrorCode, message: str) -> p.Error:
        self.counters.errors += 1
        return p.Error(rid=rid, code=code, message=message, epoch=self.epoch)

    def forbidden(self, message: str) -> p.Error:
        self.counters.forbidden += 1
        return self.error(0, "forbidden", message)

    def tick(self) -> None:
        """Applies TTLs and deadlines: lock groups, operations, pending lookups, sessions,
        silent clients. Flushes the chunk log."""
        for released in self.cache.expire_groups():
            self.counters.expired_locks += released.num_locks
            self._record_release(a.SERVER_LOCK_EXPIRE, "ttl", released)
        now = self.clock()
        for kind, owner, ident in list(self.deadlines.due(now)):
            self._expire(kind, owner, ident, now)
        for client_id in [
            c for c, state in self.clients.items() if now - state.last_seen > self._client_ttl()
        ]:
            self.reap_client(client_id, "client_timeout")
        if len(self.deadlines) > 4 * (len(self.sessions) + self._num_ops()) + 1024:
            self.deadlines.compact(self._live_deadlines())
        self.chunk_log.flush()

    def reap_client(self, client_id: bytes, reason: str) -> None:
        """Forgets a client: its operations, lock groups, sessions and registration."""
        client = self.clients.pop(client_id, None)
        self._running.pop(client_id, None)
        self._queued.pop(client_id, None)
        if client is None:
            return
        log.info("client %s gone (%s)", client_id.hex(), reason)
        ops = len(client.stores) + len(client.retrieves)
        for op_id in list(client.stores):
            transfers.finish_store(self, client, op_id, ok=False)
        for op_id in list(client.retrieves):
            transfers.finish_retrieve(self, client, op_id, ok=[])
        for group in self.cache.groups_of(client_id):
            keys = group.keys
            units = self.cache.release_group(group)
            if units:
                held = self.clock() - group.taken_at
                self._record_release(
                    a.SERVER_LOCK_EXPIRE, reason, Released(group.session_id, keys, units, held)
                )
        for session_id in list(client.sessions):
            self.drop_session(session_id)
        if client.worker is not None:
            client.worker.close()
        with telemetry.traced(
            a.SERVER_CLIENT_GONE,
            attributes={a.CLIENT: client_id.hex(), a.REASON: reason, a.OPS: ops},
        ):
            pass

    def quiescence(self) -> dict[str, int]:
        """What the server still holds: all zeros when nothing is locked, pinned or in
        flight (the end-of-run invariant)."""
        return {
            "locks": self.cache.num_locks,
            "pins": self.cache.num_pins,
            "inflight_stores": sum(len(c.stores) for c in self.clients.values()),
            "inflight_retrieves": sum(len(c.retrieves) for c in self.clients.values()),
            "pending_lookups": sum(1 for s in self.sessions.values() if s.pending is not None),
        }

    # -----------------------------------------------------------------------------------------
    # Helpers for the handlers
    # -----------------------------------------------------------------------------------------

    def session(self, call: Call, session_id: str, *, create: bool) -> Session | None:
        """The caller's session ``session_id`` (created if ``create``); ``forbidden`` if it
        belongs to another client."""
        session = self.sessions.get(session_id)
        if session is not None:
            if session.owner != call.client.client_id:
                self.counters.forbidden += 1
                raise ServiceError("forbidden", f"session {session_id!r} belongs to another client")
            session.last_seen = self.clock()
            return session
        if not create:
            return None
        if len(self.sessions) >= self.config.max_sessions:
            raise self.limit("max_sessions", self.config.max_sessions, "live sessions")
        quotas.check_sessions(self, call.client)
        session = Session(session_id, call.client.client_id, self.clock())
        self.sessions[session_id] = session
        call.client.sessions.add(session_id)
        self.deadlines.add(self.clock() + self.config.session_ttl_s, "session", b"", session_id)
        return session

    def drop_session(self, session_id: str) -> None:
        session = self.sessions.pop(session_id, None)
        if session is None:
            return
        self.tracked_chunks -= session.tracked_chunks
        owner = self.clients.get(session.owner)
        if owner is not None:
            owner.sessions.discard(session_id)
            owner.tracked_chunks -= session.tracked_chunks

    def track(self, session: Session, run: ChunkRun, *, lookup: bool) -> None:
        """Records ``run`` for the session's refresh (a lookup's replaces the previous lookup's),
        within its client's quota (``server.quotas``) and ``max_tracked_chunks``: over either,
        a lookup is refused; a store's objects are simply not refreshed."""
        replaced = session.looked_up.num_objects if lookup and session.looked_up else 0
        owner = self.clients.get(session.owner)
        locking = len(run.hashes) if lookup else 0  # the lookup's lock group, taken next
        added = run.num_objects - replaced + locking
        if owner is not None and not quotas.tracked_fits(self, owner, added):
            if not lookup:
                return
            raise quotas.refuse_tracked(self)
        over = self.tracked_chunks - replaced + self.cache.locked_chunks + run.num_objects
        if over > self.config.max_tracked_chunks:
            if not lookup:
                return
            raise self.limit(
                "max_tracked_chunks", self.config.max_tracked_chunks, "chunks tracked by sessions"
            )
        self.tracked_chunks += run.num_objects - replaced
        if owner is not None:
            owner.tracked_chunks += run.num_objects - replaced
        if lookup:
            session.looked_up = run
        else:
            session.stored.append(run)

    def limit(self, name: str, value: int, what: str) -> ServiceError:
        self.counters.refused_limits += 1
        flag = "--" + name.replace("_", "-")
        return ServiceError("limit", f"refused: over the server's limit of {value} {what} ({flag})")

    def pending_expiry(self, pending: PendingLookup) -> float:
        """When a pending lookup nobody polls is forgotten: its own timeout again after its
        deadline (a poll after that is answered ``unknown_id``, which clients take as a miss)."""
        return pending.deadline + max(1.0, self.config.lookup_pending_timeout_s)

    def check_chunks(self, num_chunks: int) -> None:
        if num_chunks > self.config.max_chunks_per_request:
            self.counters.refused_limits += 1
            raise ServiceError(
                "limit",
                f"refused: {num_chunks} chunks in one request exceed the server's limit of "
                f"{self.config.max_chunks_per_request} (--max-chunks-per-request); split the "
                "request",
            )

    def record_eviction(self, eviction: Eviction, parent: str = "") -> None:
        """The evict span (linked to the stores that wrote the objects) and its chunk log."""
        if not eviction.objects:
            return
        self.evictions.record(eviction.keys)
        if eviction.reason == "capacity":
            self.counters.evicted_objects += len(eviction.objects)
            self.counters.evicted_bytes += eviction.nbytes
        storers = sorted({obj.storer for obj in eviction.objects if obj.storer})
        span = telemetry.start_span(
            a.SERVER_EVICT,
            parent=parent,
            links=eviction.origins[:MAX_LINKS],
            attributes={
                a.EVICTED_OBJECTS: len(eviction.objects),
                a.EVICTED_BYTES: eviction.nbytes,
                a.EVICT_REASON: eviction.reason,
                a.POLICY: self.config.policy,
                a.USED_BYTES: self.cache.used_bytes,
                a.CAPACITY_BYTES: self.cache.capacity_bytes,
                a.SESSION_IDS: storers[:MAX_LINKS],
            },
        )
        if self.chunk_log.enabled:
            from server.chunk_log import DROP, EVICT, namespace

            span_id = telemetry.span_id_of(span)
            event = EVICT if eviction.reason == "capacity" else DROP
            for obj in eviction.objects:
                key = obj.key
                self.chunk_log.add(
                    event,
                    key.chunk_hash,
                    kv_rank=key.kv_rank,
                    namespace=namespace(key.model, key.world_size, key.cache_salt),
                    session_id=obj.storer,
                    cause=eviction.reason,
                    span_id=span_id,
                    nbytes=obj.nbytes,
                )
        span.end()

    def index_bytes(self) -> int:
        return (
            self.cache.index_bytes()
            + len(self.sessions) * SESSION_INDEX_BYTES
            + self.tracked_chunks * TRACKED_CHUNK_INDEX_BYTES
            + len(self.clients) * CLIENT_INDEX_BYTES
        )

    # -----------------------------------------------------------------------------------------
    # Internal
    # -----------------------------------------------------------------------------------------

    def _refused(self, request: p.Request, refusal: p.Error) -> p.Error:
        """``refusal`` (of the batch ``request`` came in) as the reply to ``request``."""
        return p.Error(
            rid=request.rid, code=refusal.code, message=refusal.message, epoch=self.epoch
        )

    def _refusal(self, request: p.Request | p.Batch) -> p.Error | None:
        """An error for a request that must not reach any state (version, credential)."""
        if request.v != p.PROTOCOL_VERSION:
            return self.error(
                request.rid,
                "version",
                f"protocol version {request.v} is not supported; this server speaks "
                f"{p.PROTOCOL_VERSION} (upgrade the client or the server)",
            )
        if isinstance(request, p.Ping):
            return None
        if not self.credentials.is_client(request.auth):
            self.counters.unauthorized += 1
            return self.error(
                request.rid,
                "unauthorized",
                "missing or wrong credential: send the server's token (its token file is "
                "printed in the readiness line; clients read it from kvtb.token_file or "
                "KVTB_TOKEN_FILE)",
            )
        if isinstance(request, p.ADMIN_REQUESTS) and not self.credentials.is_admin(request.auth):
            self.counters.unauthorized += 1
            return self.error(
                request.rid,
                "unauthorized",
                f"{p.op_name(request)} is an administration request: it needs the admin token",
            )
        return None

    def _start(self, client: ClientState, request: p.Request) -> list[tuple[bytes, p.Reply]]:
        name = _SPANS[type(request)]
        span: telemetry.Span = telemetry.INVALID_SPAN
        if name is not None:
            span = telemetry.start_span(
                name,
                kind=SpanKind.SERVER,
                parent=request.traceparent,
                tracestate=request.tracestate,
                attributes={a.OP: p.op_name(request), a.EPOCH: self.epoch},
            )
        call = Call(
            client, request, span, telemetry.span_id_of(span), telemetry.traceparent_of(span)
        )
        task = _Task(call, self._handlers[type(request)](self, call, request))
        reply = self._step(task)
        if reply is None:
            self._running[client.client_id] = task
            return []
        return [(client.client_id, reply)]

    def _step(self, task: _Task) -> p.Reply | None:
        """Runs the task to its next yield (``None``) or to its reply; ends its span."""
        call = task.call
        rid = call.request.rid
        try:
            next(task.steps)
            return None
        except StopIteration as done:
            reply: p.Reply = done.value
            reply.rid = rid
            reply.epoch = self.epoch
        except ServiceError as exc:
            telemetry.fail(call.span, f"{exc.code}: {exc}")
            reply = self.error(rid, exc.code, str(exc))
        except Exception as exc:  # a bug must not take the server down
            log.exception("internal error handling %s", type(call.request).__name__)
            telemetry.fail(call.span, f"internal: {type(exc).__name__}: {exc}")
            reply = self.error(rid, "internal", f"{type(exc).__name__}: {exc}")
        call.span.end()
        return reply

    def _client_ttl(self) -> float:
        return self.config.client_timeout_s

    def _num_ops(self) -> int:
        return sum(len(c.stores) + len(c.retrieves) for c in self.clients.values())

    def _live_deadlines(self) -> list[tuple[float, str, bytes, object]]:
        live: list[tuple[float, str, bytes, object]] = []
        for client in self.clients.values():
            live += [(op.deadline, "store", client.client_id, i) for i, op in client.stores.items()]
            live += [
                (op.deadline, "retrieve", client.client_id, i) for i, op in client.retrieves.items()
            ]
        for session in self.sessions.values():
            live.append((session.last_seen + self.config.session_ttl_s, "session", b"", session))
            if session.pending is not None:
                expiry = self.pending_expiry(session.pending)
                live.append((expiry, "pending", b"", session.session_id))
        return [(d, k, o, s.session_id if isinstance(s, Session) else s) for d, k, o, s in live]

    def _expire(self, kind: str, owner: bytes, ident: object, now: float) -> None:
        if kind in ("store", "retrieve"):
            assert isinstance(ident, int)
            client = self.clients.get(owner)
            if client is None:
                return
            op = (client.stores if kind == "store" else client.retrieves).get(ident)
            if op is None or op.deadline > now:
                return
            self.counters.expired_ops += 1
            with telemetry.traced(
                a.SERVER_OP_EXPIRE,
                attributes={a.OP: kind, a.OP_ID: ident, a.CLIENT: owner.hex()},
            ):
                if kind == "store":
                    transfers.finish_store(self, client, ident, ok=False)
                else:
                    transfers.finish_retrieve(self, client, ident, ok=[])
        elif kind == "pending":
            session = self.sessions.get(str(ident))
            if session is not None and session.pending is not None:
                expiry = self.pending_expiry(session.pending)
                if expiry <= now:
                    session.pending = None  # nobody polled: nothing held, nothing in flight
                else:
                    self.deadlines.add(expiry, "pending", b"", session.session_id)
        elif kind == "session":
            session = self.sessions.get(str(ident))
            if session is None:
                return
            expires = session.last_seen + self.config.session_ttl_s
            if expires <= now:
                self.drop_session(session.session_id)
            else:
                self.deadlines.add(expires, "session", b"", session.session_id)

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


# ---------------------------------------------------------------------------------------------
# Housekeeping requests
# ---------------------------------------------------------------------------------------------


def _ping(s: CacheService, call: Call, req: p.Request) -> Generator[None, None, p.Reply]:
    return p.Pong(server_version=SERVER_VERSION, pid=os.getpid())
    yield


def _ack(s: CacheService, call: Call, req: p.Request) -> Generator[None, None, p.Reply]:
    return p.Ack()
    yield


def _get_config(s: CacheService, call: Call, req: p.Request) -> Generator[None, None, p.Reply]:
    c = s.config
    return p.ServerConfigInfo(
        chunk_size=c.chunk_size,
        capacity_bytes=c.capacity_bytes,
        policy=c.policy,
        metadata_only=c.metadata_only,
        read_lock_ttl_s=c.read_lock_ttl_s,
        session_ttl_s=c.session_ttl_s,
        op_ttl_s=c.op_ttl_s,
        max_chunks_per_request=c.max_chunks_per_request,
        min_object_bytes=c.min_object_bytes,
        eviction_seq=s.evictions.seq,
        pool_medium=None if s.pool is None else s.pool.medium,
    )
    yield


def _get_stats(s: CacheService, call: Call, req: p.Request) -> Generator[None, None, p.Reply]:
    s.chunk_log.flush()  # so that its count of rows it could not write is current
    c = s.counters
    quiet = s.quiescence()
    return p.ServerStats(
        num_objects=len(s.cache),
        used_bytes=s.cache.used_bytes,
        capacity_bytes=s.cache.capacity_bytes,
        num_locks=s.cache.num_locks,
        num_lock_groups=len(s.cache.groups),
        num_pins=s.cache.num_pins,
        num_sessions=len(s.sessions),
        num_clients=len(s.clients),
        num_workers=sum(1 for client in s.clients.values() if client.worker is not None),
        num_pending_lookups=quiet["pending_lookups"],
        num_inflight_stores=quiet["inflight_stores"],
        num_inflight_retrieves=quiet["inflight_retrieves"],
        num_tracked_chunks=s.tracked_chunks + s.cache.locked_chunks,
        index_bytes=s.index_bytes(),
        evicted_objects=c.evicted_objects,
        evicted_bytes=c.evicted_bytes,
        expired_locks=c.expired_locks,
        expired_ops=c.expired_ops,
        aborted_ops=c.aborted_ops,
        stored_bytes=c.stored_bytes,
        retrieved_bytes=c.retrieved_bytes,
        errors=c.errors,
        unauthorized=c.unauthorized,
        forbidden=c.forbidden,
        refused_limits=c.refused_limits,
        dropped_frames=c.dropped_frames,
        refused_quotas=c.refused_quotas,
        chunk_events_dropped=s.chunk_log.dropped_rows,
        chunk_events_pending=s.chunk_log.pending_rows,
        unauthenticated_closed=c.unauthenticated_closed,
    )
    yield
