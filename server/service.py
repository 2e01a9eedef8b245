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
  :data:`server.context.SLICE_UNITS` chunk operations; other clients' requests are served
  between slices, and a client's own later requests wait behind it, so each client sees its
  requests handled in order. Handlers are generators that ``yield`` between slices.
- **Errors**: handlers raise :class:`ServiceError` for a client's mistake; any exception
  becomes an ``Error`` reply and the server keeps serving.

The service only dispatches: it checks credentials, routes each request to the handler typed
for it (:class:`server.context.Routes`) inside a SERVER span parented on the client's
propagated context, and runs the housekeeping. The state has owners: the sessions and their
lookups (:class:`server.sessions.Sessions`), the transfers (:class:`server.transfers.Transfers`)
and what they share (:class:`server.context.Shared`). Evictions, lock expiries and expired
operations get INTERNAL spans of their own; chunk events go to the chunk log
(``server.chunk_log``).
"""

from __future__ import annotations

import logging
import secrets
import time
import typing
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from server.admin import Admin
from server.auth import Credentials
from server.cache import KVCache
from server.chunk_log import NullChunkLog
from server.config import ServerConfig
from server.context import Call, Routes, ServiceError, Shared, Steps, at_once
from server.objects import Released
from server.peering import Peering
from server.pool import ExtentAllocator
from server.pools import MemoryPool, make_pool
from server.sessions import Sessions
from server.state import ClientState, Counters, DeadlineKind
from server.tiers.build import make_hierarchy
from server.tiers.hierarchy import TIER_PROMOTE
from server.transfers import Transfers
from testbed.core import protocol as p
from testbed.core import telemetry
from testbed.core.chunk_events import COMMIT
from testbed.core.policies import make_policy
from testbed.core.quiescence import Quiescence
from testbed.core.telemetry import SpanKind
from testbed.core.telemetry import attributes as a

log = logging.getLogger(__name__)


@dataclass
class _Task:
    call: Call
    steps: Steps


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
        pool = (
            None
            if config.metadata_only
            else make_pool(
                config.pool_medium, config.capacity_bytes, config.pool_device, config.pool_dir
            )
        )
        allocator = None if pool is None else ExtentAllocator(pool.size)
        cache = KVCache(
            config.capacity_bytes, make_policy(config.policy), allocator, clock,
            config.read_lock_ttl_s,
        )  # fmt: skip
        self.shared = Shared(
            config, clock, secrets.randbits(62) + 1, pool, cache, chunk_log or NullChunkLog()
        )
        try:
            self.shared.tiers = make_hierarchy(
                config, cache, None if pool is None else pool.array, clock
            )
            self.shared.tiers.feed = self.shared.evictions
        except BaseException:
            if pool is not None:
                pool.close()
            raise
        self.peering = Peering(self.shared)
        self.sessions = Sessions(self.shared, self.peering)
        self.transfers = Transfers(self.shared, self.sessions)
        self._expiries: dict[DeadlineKind, Callable[[str, bytes, object, float], None]] = {
            "store": self.transfers.expire,
            "retrieve": self.transfers.expire,
            "pending": self.sessions.expire,
            "session": self.sessions.expire,
        }
        if set(self._expiries) != set(typing.get_args(DeadlineKind)):
            raise TypeError("a kind of deadline has no owner to expire it")
        self._routes = self._route()
        self._running: dict[bytes, _Task] = {}
        self._queued: dict[bytes, deque[tuple[p.Request, int]]] = {}
        """Per client, the requests waiting behind its running one, each with when it was
        read (``received_ns``)."""

    def _route(self) -> Routes:
        routes, sessions, transfers = Routes(), self.sessions, self.transfers
        info = self._admin = Admin(self.shared, self.sessions, self.quiescence)
        routes.add(p.Ping, at_once(info.ping), None)
        routes.add(p.Heartbeat, at_once(info.ack), None)
        routes.add(p.GetConfig, at_once(info.get_config), None)
        routes.add(p.GetStats, at_once(info.get_stats), None)
        routes.add(p.RegisterWorker, at_once(transfers.register), a.SERVER_REGISTER)
        routes.add(p.UnregisterWorker, at_once(transfers.unregister), None)
        routes.add(p.Lookup, sessions.lookup, a.SERVER_LOOKUP)
        routes.add(p.LookupPoll, sessions.lookup_poll, a.SERVER_LOOKUP)
        routes.add(p.FreeLocks, at_once(sessions.free_locks), a.SERVER_LOCK_RELEASE)
        routes.add(p.EndSession, sessions.end_session, a.SERVER_END_SESSION)
        routes.add(p.StoreBegin, transfers.store_begin, a.SERVER_STORE)
        routes.add(p.StoreCommit, at_once(transfers.store_commit), a.SERVER_STORE)
        routes.add(p.RetrieveBegin, transfers.retrieve_begin, a.SERVER_RETRIEVE)
        routes.add(p.RetrieveEnd, at_once(transfers.retrieve_end), a.SERVER_RETRIEVE)
        routes.add(p.Abort, at_once(transfers.abort), a.SERVER_ABORT)
        routes.add(p.DropObjects, info.drop_objects, None)
        routes.add(p.GetHeld, at_once(sessions.get_held), None)
        routes.add(p.SetPeers, at_once(self.peering.set_peers), a.SERVER_SET_PEERS)
        routes.add(p.PeerProbe, at_once(self.peering.probe), a.SERVER_PEER_PROBE)
        routes.add(p.PeerFetch, at_once(self.peering.fetch), a.SERVER_PEER_SERVE)
        routes.check_complete()
        return routes

    # -----------------------------------------------------------------------------------------
    # What the server process reads of the service
    # -----------------------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self.shared.epoch

    @property
    def pool(self) -> MemoryPool | None:
        return self.shared.pool

    @property
    def counters(self) -> Counters:
        return self.shared.counters

    def stats(self) -> p.ServerStats:
        """What ``GetStats`` answers, read in the server's loop (the metrics endpoint's
        source: ``server.metrics``)."""
        return self._admin.stats()

    def close(self) -> None:
        self.peering.close()
        self.shared.tiers.close()
        self.shared.chunk_log.close()
        for client in self.shared.clients.values():
            if client.worker is not None:
                client.worker.close()
        if self.shared.pool is not None:
            self.shared.pool.close()

    def __enter__(self) -> CacheService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -----------------------------------------------------------------------------------------
    # Entry points
    # -----------------------------------------------------------------------------------------

    def handle(
        self, client_id: bytes, request: p.Request | p.Batch, received_ns: int = 0
    ) -> list[tuple[bytes, p.Reply]]:
        """Replies ready now for one decoded request (none if it waits behind the client's
        earlier request, or was split into slices: :meth:`advance` finishes it). A batch's
        requests are handled one by one, in order, as if each had come alone.
        ``received_ns``: when its frame was read (``time.monotonic_ns``), stamped on its reply."""
        if isinstance(request, p.Batch):
            refusal = self._refusal(request)
            if refusal is not None:
                return [(client_id, self._refused(item, refusal)) for item in request.requests]
            return [
                reply
                for item in request.requests
                for reply in self.handle(client_id, item, received_ns)
            ]
        refusal = self._refusal(request)
        if refusal is not None:
            return [(client_id, refusal)]
        clients = self.shared.clients
        client = clients.get(client_id)
        if client is None:
            client = clients[client_id] = ClientState(client_id, self.clock())
        client.last_seen = self.clock()
        if client_id in self._running:
            self._queued.setdefault(client_id, deque()).append((request, received_ns))
            return []
        return self._start(client, request, received_ns)

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
                client = self.shared.clients.get(client_id)
                request, received_ns = queue.popleft()
                if client is None:
                    continue
                replies += self._start(client, request, received_ns)
            if not queue:
                self._queued.pop(client_id, None)
        return replies

    @property
    def busy(self) -> bool:
        """Whether requests split into slices are waiting for :meth:`advance`."""
        return bool(self._running)

    @property
    def tiers_busy(self) -> bool:
        """Whether tier I/O is in flight (the loop then collects it often: :meth:`pump`)."""
        return self.shared.tiers.busy

    def pump(self) -> None:
        """Collects finished tier I/O (prefetches reach L1, writes commit below), records the
        L1 objects that leave with it (promotions for one load only) and logs the promotions
        (``commit`` rows, cause ``tier_promote``, status the tier's hit-source name)."""
        s = self.shared
        evictions, promoted = s.tiers.pump()
        for eviction in evictions:
            s.record_eviction(eviction)
        if s.chunk_log.enabled:
            for obj, source in promoted:
                s.chunk_log.add_object(
                    COMMIT,
                    obj.key,
                    session_id=obj.storer,
                    status=source,
                    cause=TIER_PROMOTE,
                    nbytes=obj.nbytes,
                )

    def error(self, rid: int, code: p.ErrorCode, message: str) -> p.Error:
        counters = self.shared.counters
        counters.errors += 1
        counters.errors_by_code[code] = counters.errors_by_code.get(code, 0) + 1
        return p.Error(rid=rid, code=code, message=message, epoch=self.epoch)

    def forbidden(self, message: str) -> p.Error:
        self.shared.counters.forbidden += 1
        return self.error(0, "forbidden", message)

    def tick(self) -> None:
        """Applies TTLs and deadlines: lock groups, operations, pending lookups, sessions,
        silent clients. Flushes the chunk log."""
        s = self.shared
        self.pump()
        for released in s.cache.expire_groups():
            s.counters.expired_locks += released.num_locks
            self._record_release("ttl", released)
        now = self.clock()
        for kind, owner, ident in list(s.deadlines.due(now)):
            self._expiries[kind](kind, owner, ident, now)
        ttl = self.config.client_timeout_s
        for client_id in [c for c, state in s.clients.items() if now - state.last_seen > ttl]:
            self.reap_client(client_id, "client_timeout")
        num_ops = sum(len(c.stores) + len(c.retrieves) for c in s.clients.values())
        if len(s.deadlines) > 4 * (len(self.sessions.live) + num_ops) + 1024:
            s.deadlines.compact(self.transfers.live_deadlines() + self.sessions.live_deadlines())
        s.chunk_log.flush()

    def reap_client(self, client_id: bytes, reason: str) -> None:
        """Forgets a client: its operations, lock groups, sessions and registration."""
        s = self.shared
        client = s.clients.pop(client_id, None)
        self._running.pop(client_id, None)
        self._queued.pop(client_id, None)
        if client is None:
            return
        log.info("client %s gone (%s)", client_id.hex(), reason)
        ops = self.transfers.drop_client(client)
        for group in s.cache.groups_of(client_id):
            keys = group.keys
            units = s.cache.release_group(group)
            if units:
                held = self.clock() - group.taken_at
                self._record_release(reason, Released(group.session_id, keys, units, held))
        self.sessions.drop_client(client)
        with telemetry.traced(
            a.SERVER_CLIENT_GONE,
            attributes={a.CLIENT: client_id.hex(), a.REASON: reason, a.OPS: ops},
        ):
            pass

    def quiescence(self) -> Quiescence:
        """What the server still holds: all zeros when nothing is locked, pinned or in
        flight (the end-of-run invariant)."""
        clients = self.shared.clients.values()
        return Quiescence(
            num_locks=self.shared.cache.num_locks,
            num_pins=self.shared.cache.num_pins,
            num_inflight_stores=sum(len(c.stores) for c in clients),
            num_inflight_retrieves=sum(len(c.retrieves) for c in clients),
            num_pending_lookups=self.sessions.num_pending,
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
            self.shared.counters.unauthorized += 1
            return self.error(
                request.rid,
                "unauthorized",
                "missing or wrong credential: send the server's token (its token file is "
                "printed in the readiness line; clients read it from kvtb.token_file or "
                "KVTB_TOKEN_FILE)",
            )
        if isinstance(request, p.ADMIN_REQUESTS) and not self.credentials.is_admin(request.auth):
            self.shared.counters.unauthorized += 1
            return self.error(
                request.rid,
                "unauthorized",
                f"{p.op_name(request)} is an administration request: it needs the admin token",
            )
        return None

    def _start(
        self, client: ClientState, request: p.Request, received_ns: int
    ) -> list[tuple[bytes, p.Reply]]:
        route = self._routes[type(request)]
        span: telemetry.Span = telemetry.INVALID_SPAN
        if route.span is not None:
            span = telemetry.start_span(
                route.span,
                kind=SpanKind.SERVER,
                parent=request.traceparent,
                tracestate=request.tracestate,
                attributes={a.OP: p.op_name(request), a.EPOCH: self.epoch},
            )
        call = Call(
            client,
            request,
            span,
            telemetry.span_id_of(span),
            telemetry.traceparent_of(span),
            received_ns=received_ns,
        )
        task = _Task(call, route.handler(call, request))
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
        reply.received_ns = call.received_ns
        call.span.end()
        return reply

    def _record_release(self, reason: str, released: Released) -> None:
        with telemetry.traced(
            a.SERVER_LOCK_EXPIRE,
            attributes={
                a.SESSION_ID: released.session_id,
                a.CHUNKS: len(released.keys),
                a.LOCKS_RELEASED: released.num_locks,
                a.HELD_MS: released.held_s * 1e3,
                a.EVICT_REASON: reason,
            },
        ):
            pass
