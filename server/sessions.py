"""Sessions and the scheduler-side requests: lookup (and its polls), lock release, end of
session, and what one engine's sessions hold.

Runs in the cache server process. :class:`Sessions` owns the live sessions and the chunks they
track for their end-of-session refresh; its handlers take their own request types (routed by
``server.service``) and are generators that ``yield`` between slices of work. A session belongs
to the client that looked it up first; it expires ``session_ttl_s`` after its last use, and a
pending lookup nobody polls is forgotten after its timeout.
"""

from __future__ import annotations

import secrets
from collections.abc import Generator
from typing import Final

from server import quotas
from server.context import Call, ServiceError, Shared, Steps
from server.held import held_by
from server.mirror_checks import LookupOrder, count_mirror
from server.objects import CacheObject, Space
from server.peering import P2P_SOURCE, Peering
from server.state import (
    SESSION_INDEX_BYTES,
    TRACKED_CHUNK_INDEX_BYTES,
    ChunkRun,
    ClientState,
    Deadline,
    PendingLookup,
    Session,
)
from server.tiers.lookups import (
    hit_sources,
    logged_statuses,
    prefetch,
    tier_miss_status,
    writing_below,
)
from testbed.core import protocol as p
from testbed.core.chunk_events import LOOKUP, TOUCH, namespace
from testbed.core.telemetry import attributes as a

HIT: Final = "hit"
IN_FLIGHT: Final = "in_flight"
ABSENT: Final = "absent"


class Sessions:
    """The live sessions, by id; ``tracked_chunks``: the objects their refresh lists name."""

    def __init__(self, shared: Shared, peering: Peering) -> None:
        self.s = shared
        self.peering = peering
        """Asked after a local miss (a no-op until the server is given peers)."""
        self.live: dict[str, Session] = {}
        self.tracked_chunks = 0
        self.order = LookupOrder()
        """The unlocked lookups read, for the stores sent after them (``server.mirror_checks``)."""

    # -----------------------------------------------------------------------------------------
    # State
    # -----------------------------------------------------------------------------------------

    def session(self, call: Call, session_id: str, *, create: bool) -> Session | None:
        """The caller's session ``session_id`` (created if ``create``); ``forbidden`` if it
        belongs to another client."""
        s = self.s
        session = self.live.get(session_id)
        if session is not None:
            if session.owner != call.client.client_id:
                s.counters.forbidden += 1
                raise ServiceError("forbidden", f"session {session_id!r} belongs to another client")
            session.last_seen = s.clock()
            return session
        if not create:
            return None
        if len(self.live) >= s.config.max_sessions:
            raise s.limit("max_sessions", s.config.max_sessions, "live sessions")
        quotas.check_sessions(s, call.client)
        session = Session(session_id, call.client.client_id, s.clock())
        self.live[session_id] = session
        call.client.sessions.add(session_id)
        s.deadlines.add(s.clock() + s.config.session_ttl_s, "session", b"", session_id)
        return session

    def drop(self, session_id: str) -> None:
        session = self.live.pop(session_id, None)
        if session is None:
            return
        self.s.tiers.release_session(session_id)
        self.tracked_chunks -= session.tracked_chunks
        owner = self.s.clients.get(session.owner)
        if owner is not None:
            owner.sessions.discard(session_id)
            owner.tracked_chunks -= session.tracked_chunks

    def drop_client(self, client: ClientState) -> None:
        """Forgets the sessions of a client that is gone."""
        for session_id in list(client.sessions):
            self.drop(session_id)

    def track(self, session: Session, run: ChunkRun, *, lookup: bool) -> None:
        """Records ``run`` for the session's refresh (a lookup's replaces the previous lookup's),
        within its client's quota (``server.quotas``) and ``max_tracked_chunks``: over either,
        a lookup is refused; a store's objects are simply not refreshed."""
        s = self.s
        replaced = session.looked_up.num_objects if lookup and session.looked_up else 0
        owner = s.clients.get(session.owner)
        locking = len(run.hashes) if lookup else 0  # the lookup's lock group, taken next
        added = run.num_objects - replaced + locking
        if owner is not None and not quotas.tracked_fits(s, owner, added):
            if not lookup:
                return
            raise quotas.refuse_tracked(s)
        over = self.tracked_chunks - replaced + s.cache.locked_chunks + run.num_objects
        if over > s.config.max_tracked_chunks:
            if not lookup:
                return
            raise s.limit(
                "max_tracked_chunks", s.config.max_tracked_chunks, "chunks tracked by sessions"
            )
        self.tracked_chunks += run.num_objects - replaced
        if owner is not None:
            owner.tracked_chunks += run.num_objects - replaced
        if lookup:
            session.looked_up = run
        else:
            session.stored.append(run)

    def pending_expiry(self, pending: PendingLookup) -> float:
        """When a pending lookup nobody polls is forgotten: its own timeout again after its
        deadline (a poll after that is answered ``unknown_id``, which clients take as a miss)."""
        return pending.deadline + max(1.0, self.s.config.lookup_pending_timeout_s)

    @property
    def num_pending(self) -> int:
        return sum(1 for session in self.live.values() if session.pending is not None)

    def index_bytes(self) -> int:
        return len(self.live) * SESSION_INDEX_BYTES + self.tracked_chunks * (
            TRACKED_CHUNK_INDEX_BYTES
        )

    def expire(self, kind: str, owner: bytes, ident: object, now: float) -> None:
        """A ``pending`` lookup's or a ``session``'s deadline came: forgets it if it passed,
        else waits for the new one."""
        session = self.live.get(str(ident))
        if session is None:
            return
        if kind == "pending":
            if session.pending is None:
                return
            expiry = self.pending_expiry(session.pending)
            if expiry <= now:
                session.pending = None  # nobody polled: nothing held, nothing in flight
            else:
                self.s.deadlines.add(expiry, "pending", b"", session.session_id)
            return
        expires = session.last_seen + self.s.config.session_ttl_s
        if expires <= now:
            self.drop(session.session_id)
        else:
            self.s.deadlines.add(expires, "session", b"", session.session_id)

    def live_deadlines(self) -> list[Deadline]:
        live: list[Deadline] = []
        for session in self.live.values():
            expires = session.last_seen + self.s.config.session_ttl_s
            live.append((expires, "session", b"", session.session_id))
            if session.pending is not None:
                expiry = self.pending_expiry(session.pending)
                live.append((expiry, "pending", b"", session.session_id))
        return live

    # -----------------------------------------------------------------------------------------
    # Handlers
    # -----------------------------------------------------------------------------------------

    def lookup(self, call: Call, req: p.Lookup) -> Steps:
        s = self.s
        s.check_chunks(len(req.chunk_hashes) * req.world_size)  # one object per chunk and rank
        session = self.session(call, req.session_id, create=True)
        assert session is not None
        # A new lookup replaces the session's previous one (e.g. after a preemption).
        previous = s.cache.groups.get(session.handle)
        if previous is not None:
            s.cache.release_group(previous)
        session.handle = b""
        session.pending = None
        if req.commits and req.evictions_after is not None:
            s.evictions.commits_wanted = True  # a mirror reads L1's commits from now on
        if not req.lock:
            self.order.read(req.session_id)
        pending = PendingLookup(req, s.clock() + s.config.lookup_pending_timeout_s)
        return (yield from self._settle(call, session, pending))

    def lookup_poll(self, call: Call, req: p.LookupPoll) -> Steps:
        session = self.session(call, req.session_id, create=False)
        if session is None or session.pending is None:
            raise ServiceError("unknown_id", f"no pending lookup for session {req.session_id!r}")
        pending, session.pending = session.pending, None
        pending.polls += 1
        return (yield from self._settle(call, session, pending))

    def free_locks(self, call: Call, req: p.FreeLocks) -> p.Reply:
        cache = self.s.cache
        session = self.session(call, req.session_id, create=False)
        chunk_size = self.s.config.chunk_size
        first = -(-req.start_token // chunk_size)  # first chunk starting at or after start
        last = req.end_token // chunk_size  # chunks ending at or before end
        num_chunks = num_locks = 0
        group = None if session is None else cache.groups.get(session.handle)
        if group is not None:
            num_chunks = cache.chunks_held(group, first, last)
            num_locks = cache.release_range(group, first, last)
        call.span.set_attributes(
            {
                a.SESSION_ID: req.session_id,
                a.RANGE_START: req.start_token,
                a.RANGE_END: req.end_token,
                a.CHUNKS: num_chunks,
                a.LOCKS_RELEASED: num_locks,
            }
        )
        return p.LocksFreed(num_chunks=num_chunks, num_locks=num_locks)

    def end_session(self, call: Call, req: p.EndSession) -> Steps:
        s = self.s
        session = self.session(call, req.session_id, create=False)
        runs = [] if session is None else session.refresh
        call.span.set_attributes(
            {
                a.SESSION_ID: req.session_id,
                a.CHUNKS: sum(run.num_objects for run in runs),
                a.LOCKS_RELEASED: 0,
            }
        )
        for run in runs:
            space = namespace(*run.space)
            for key in run.object_keys():
                s.cache.touch(key)
                if s.chunk_log.enabled and s.cache.get(key) is not None:
                    s.chunk_log.add(
                        TOUCH,
                        key.chunk_hash,
                        kv_rank=key.kv_rank,
                        namespace=space,
                        session_id=req.session_id,
                        cause="end_session",
                        span_id=call.span_id,
                    )
                if call.spend():
                    yield
        self.drop(req.session_id)
        return p.Ack()

    def get_held(self, call: Call, req: p.GetHeld) -> p.Reply:
        return held_by(self.s.cache, self.s.clients.values(), self.live, req.owner)

    # -----------------------------------------------------------------------------------------
    # Settling a lookup
    # -----------------------------------------------------------------------------------------

    def _settle(self, call: Call, session: Session, pending: PendingLookup) -> Steps:
        s = self.s
        req = pending.request
        chunk_size = s.config.chunk_size
        statuses, objects, hit, miss_status = yield from self._find(call, pending)
        call.span.set_attributes(
            {
                a.SESSION_ID: req.session_id,
                a.CHUNKS_REQUESTED: len(req.chunk_hashes),
                a.TOKENS_REQUESTED: len(req.chunk_hashes) * chunk_size,
                a.NUM_READERS: req.num_readers,
                a.LOOKUP_POLLS: pending.polls,
            }
        )
        if (
            miss_status == IN_FLIGHT
            and req.lock
            and s.clock() < pending.deadline
            and quotas.may_wait(s, self.live, call.client)
        ):
            session.pending = pending
            s.deadlines.add(self.pending_expiry(pending), "pending", b"", session.session_id)
            call.span.set_attribute(a.LOOKUP_PENDING, True)
            return p.LookupResult(pending=True)
        space = Space(req.model, req.world_size, req.cache_salt)
        if s.tiers.enabled and miss_status:
            miss_status = tier_miss_status(s, pending, space, req.chunk_hashes[hit], miss_status)
        run = ChunkRun(space, req.chunk_hashes[:hit], tuple(range(req.world_size)))
        self.track(session, run, lookup=True)
        handle = secrets.token_bytes(16) if req.lock else b""
        hit_objects = objects[: hit * req.world_size]
        num_locks = 0
        if req.lock:
            num_locks = yield from self._lock_hit(call, req, handle, run, hit_objects)
        if req.mirror_hit_chunks is not None:
            count_mirror(s, call, req, hit)
        by_tier = hit_sources(pending, run.hashes)
        if s.tiers.enabled:
            s.tiers.claimed(hit_objects)
            s.tiers.release_session(req.session_id)
            s.tiers.hit(hit_objects, call.traceparent)
            call.span.set_attribute(
                a.HIT_CHUNKS_BY_TIER, [f"{name}={n}" for name, n in sorted(by_tier.items())]
            )
        session.handle = handle
        s.counters.lookups += 1
        s.counters.lookup_hit_chunks += hit
        s.counters.lookup_miss_chunks += len(req.chunk_hashes) - hit
        if s.chunk_log.enabled:
            _log_lookup(s, call, req, logged_statuses(s, pending, space, statuses, miss_status))
        call.span.set_attributes(
            {
                a.LOOKUP_PENDING: False,
                a.CHUNKS_HIT: hit,
                a.TOKENS_HIT: hit * chunk_size,
                a.LOCKS_TAKEN: num_locks,
                a.MISS_STATUS: miss_status,
            }
        )
        return _result(s, req, hit, num_locks, handle, miss_status, by_tier)

    def _find(
        self, call: Call, pending: PendingLookup
    ) -> Generator[None, None, tuple[list[str], list[CacheObject], int, p.MissStatus]]:
        """The lookup's chunk statuses (:func:`_statuses`), its hit prefix's objects, its hit
        and why the chunk after the hit is not one, once the tiers below have sent for what
        they hold and peers have filled an absent chunk and what follows it (noted as theirs)."""
        s, req = self.s, pending.request
        if s.tiers.enabled and req.lock:  # unlocked: the mirror answered, nothing is loaded
            yield from prefetch(s, call, pending)
        statuses, objects = yield from _statuses(s, call, req, full=s.chunk_log.enabled)
        hit = _hit(statuses)
        miss_status = _miss_status(statuses, hit)
        if miss_status == ABSENT and writing_below(s, req, hit):
            miss_status = IN_FLIGHT  # written below, not yet held: waited for as a store
        copied = 0
        if miss_status == ABSENT and req.lock:
            copied = yield from self.peering.fill(call, req, hit)
        if copied:
            for chunk_hash in req.chunk_hashes[hit : hit + copied]:
                pending.from_tier.setdefault(chunk_hash, P2P_SOURCE)
            statuses, objects = yield from _statuses(s, call, req, full=s.chunk_log.enabled)
            hit = _hit(statuses)
            miss_status = _miss_status(statuses, hit)
        return statuses, objects, hit, miss_status

    def _lock_hit(
        self, call: Call, req: p.Lookup, handle: bytes, run: ChunkRun, objects: list[CacheObject]
    ) -> Generator[None, None, int]:
        """Locks the hit ``run`` (its ``objects``, chunk then rank) as group ``handle``, one
        unit per reader, and refreshes their recency; returns the number of locks taken."""
        s = self.s
        space, hashes = run.space, run.hashes
        num_locks = 0
        if hashes:
            # Locked first: a locked object's recency refresh needs no eviction-heap entry.
            owner = call.client.client_id
            s.cache.lock_group(
                handle, req.session_id, owner, space, hashes, req.num_readers, objects
            )
            num_locks = len(hashes) * req.world_size * req.num_readers
        for index, obj in enumerate(objects):
            s.cache.touch_object(obj, hit=True)
            if index % 256 == 255:
                yield
        return num_locks


def _result(
    s: Shared,
    req: p.Lookup,
    hit: int,
    num_locks: int,
    handle: bytes,
    miss_status: p.MissStatus,
    by_tier: dict[str, int],
) -> p.LookupResult:
    """A settled lookup's reply; with the removals since ``req.evictions_after`` (and the
    tiers' changes if it asks) when it names a number."""
    reply = p.LookupResult(
        hit_chunks=hit,
        num_locks=num_locks,
        handle=handle,
        miss_status=miss_status,
        hit_chunks_by_tier=by_tier,
    )
    if req.evictions_after is not None:
        s.evictions.answer(req, reply)
    return reply


def _miss_status(statuses: list[str], hit: int) -> p.MissStatus:
    """Why the chunk after a hit of ``hit`` chunks is not one (empty: all hit)."""
    if hit == len(statuses):
        return ""
    return ABSENT if statuses[hit] == ABSENT else IN_FLIGHT


def _hit(statuses: list[str]) -> int:
    return next((i for i, status in enumerate(statuses) if status != HIT), len(statuses))


def _statuses(
    s: Shared, call: Call, req: p.Lookup, *, full: bool
) -> Generator[None, None, tuple[list[str], list[CacheObject]]]:
    """Each chunk's state: ``hit`` (committed on every rank), ``in_flight`` (on every rank,
    not all committed), ``absent``; and the objects of the hit prefix, chunk then rank.
    Without ``full`` it stops after the first non-hit."""
    statuses: list[str] = []
    hit_objects: list[CacheObject] = []
    in_prefix = True
    space = Space(req.model, req.world_size, req.cache_salt)
    get = s.cache.get
    for chunk_hash in req.chunk_hashes:
        objects = [get(key) for key in space.keys(chunk_hash)]
        if all(obj is not None and obj.committed for obj in objects):
            statuses.append(HIT)
            if in_prefix:
                hit_objects += objects  # type: ignore[arg-type]
        else:
            statuses.append(IN_FLIGHT if all(obj is not None for obj in objects) else ABSENT)
            in_prefix = False
            if not full:
                break
        if call.spend(req.world_size):
            yield
    return statuses, hit_objects


def _log_lookup(s: Shared, call: Call, req: p.Lookup, statuses: list[str]) -> None:
    """One ``lookup`` row per requested chunk, in position order."""
    space_name = namespace(req.model, req.world_size, req.cache_salt)
    for position, (chunk_hash, status) in enumerate(zip(req.chunk_hashes, statuses, strict=True)):
        s.chunk_log.add(
            LOOKUP,
            chunk_hash,
            namespace=space_name,
            session_id=req.session_id,
            position=position,
            status=status,
            span_id=call.span_id,
        )
