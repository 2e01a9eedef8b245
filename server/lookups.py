"""Scheduler-side requests: lookup (and its polls), lock release, end of session.

Handlers of :class:`server.service.CacheService`: generators that ``yield`` between slices
of work and return the reply. Sessions belong to the client that looked them up first.
"""

from __future__ import annotations

import secrets
from collections.abc import Generator
from typing import TYPE_CHECKING

from server import quotas
from server.cache import CacheObject, Space
from server.chunk_log import LOOKUP, TOUCH, namespace
from server.state import ChunkRun, PendingLookup, Session
from testbed.core import protocol as p
from testbed.core.telemetry import attributes as a

if TYPE_CHECKING:
    from server.context import Call, Service

HIT, IN_FLIGHT, ABSENT = "hit", "in_flight", "absent"


def lookup(s: Service, call: Call, req: p.Request) -> Generator[None, None, p.Reply]:
    assert isinstance(req, p.Lookup)
    s.check_chunks(len(req.chunk_hashes) * req.world_size)  # one object per chunk and rank
    session = s.session(call, req.session_id, create=True)
    assert session is not None
    # A new lookup replaces the session's previous one (e.g. after a preemption).
    previous = s.cache.groups.get(session.handle)
    if previous is not None:
        s.cache.release_group(previous)
    session.handle = b""
    session.pending = None
    pending = PendingLookup(req, s.clock() + s.config.lookup_pending_timeout_s)
    return (yield from _settle(s, call, session, pending))


def lookup_poll(s: Service, call: Call, req: p.Request) -> Generator[None, None, p.Reply]:
    assert isinstance(req, p.LookupPoll)
    session = s.session(call, req.session_id, create=False)
    if session is None or session.pending is None:
        raise _unknown_pending(req.session_id)
    pending, session.pending = session.pending, None
    pending.polls += 1
    return (yield from _settle(s, call, session, pending))


def _unknown_pending(session_id: str) -> Exception:
    from server.context import ServiceError

    return ServiceError("unknown_id", f"no pending lookup for session {session_id!r}")


def _settle(
    s: Service, call: Call, session: Session, pending: PendingLookup
) -> Generator[None, None, p.Reply]:
    req = pending.request
    chunk_size = s.config.chunk_size
    statuses, objects = yield from _statuses(s, call, req, full=s.chunk_log.enabled)
    hit = next((i for i, status in enumerate(statuses) if status != HIT), len(statuses))
    miss_status = statuses[hit] if hit < len(statuses) else ""
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
        and s.clock() < pending.deadline
        and quotas.may_wait(s, call.client)
    ):
        session.pending = pending
        s.deadlines.add(s.pending_expiry(pending), "pending", b"", session.session_id)
        call.span.set_attribute(a.LOOKUP_PENDING, True)
        return p.LookupResult(pending=True)
    space = Space(req.model, req.world_size, req.cache_salt)
    hashes = req.chunk_hashes[:hit]
    s.track(session, ChunkRun(space, hashes, tuple(range(req.world_size))), lookup=True)
    handle = secrets.token_bytes(16)
    num_locks = 0
    hit_objects = objects[: hit * req.world_size]
    if hashes:
        # Locked first: a locked object's recency refresh needs no eviction-heap entry.
        owner = call.client.client_id
        s.cache.lock_group(
            handle, req.session_id, owner, space, hashes, req.num_readers, hit_objects
        )
        num_locks = len(hashes) * req.world_size * req.num_readers
    for index, obj in enumerate(hit_objects):
        s.cache.touch_object(obj, hit=True)
        if index % 256 == 255:
            yield
    session.handle = handle
    if s.chunk_log.enabled:
        space_name = namespace(req.model, req.world_size, req.cache_salt)
        for position, (chunk_hash, status) in enumerate(
            zip(req.chunk_hashes, statuses, strict=True)
        ):
            s.chunk_log.add(
                LOOKUP,
                chunk_hash,
                namespace=space_name,
                session_id=req.session_id,
                position=position,
                status=status,
                span_id=call.span_id,
            )
    call.span.set_attributes(
        {
            a.LOOKUP_PENDING: False,
            a.CHUNKS_HIT: hit,
            a.TOKENS_HIT: hit * chunk_size,
            a.LOCKS_TAKEN: num_locks,
            a.MISS_STATUS: miss_status,
        }
    )
    reply = p.LookupResult(
        hit_chunks=hit, num_locks=num_locks, handle=handle, miss_status=miss_status
    )
    if req.evictions_after is not None:
        removed = s.evictions.since(
            req.evictions_after, req.model, req.world_size, p.MAX_EVICTIONS_PER_REPLY
        )
        reply.evicted = [p.EvictedChunk(salt, chunk, seq) for seq, salt, chunk in removed.chunks]
        reply.eviction_seq = removed.seq
        reply.evictions_lost = removed.lost
    return reply


def _statuses(
    s: Service, call: Call, req: p.Lookup, *, full: bool
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


def free_locks(s: Service, call: Call, req: p.Request) -> Generator[None, None, p.Reply]:
    assert isinstance(req, p.FreeLocks)
    session = s.session(call, req.session_id, create=False)
    chunk_size = s.config.chunk_size
    first = -(-req.start_token // chunk_size)  # first chunk starting at or after start
    last = req.end_token // chunk_size  # chunks ending at or before end
    num_chunks = num_locks = 0
    group = None if session is None else s.cache.groups.get(session.handle)
    if group is not None:
        num_chunks = s.cache.chunks_held(group, first, last)
        num_locks = s.cache.release_range(group, first, last)
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
    yield


def end_session(s: Service, call: Call, req: p.Request) -> Generator[None, None, p.Reply]:
    assert isinstance(req, p.EndSession)
    session = s.session(call, req.session_id, create=False)
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
    s.drop_session(req.session_id)
    return p.Ack()
