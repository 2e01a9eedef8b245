"""Scheduler-side client: non-blocking lookups, lock release, end of session.

Runs in vLLM's scheduler process. :meth:`SchedulerClient.submit_lookup` returns at once;
:meth:`SchedulerClient.lookup_result` is polled (``None`` while the answer is outstanding).
Each operation leaves a CLIENT span whose context travels in the request, so the server's
span is its child. A dead or missing server never blocks the caller: once the RPC client has
marked the server down, lookups answer 0 at once (and are not sent).

Nothing abandoned stays held: a lookup that was sent and never answered in time (the server
was frozen, busy, or the request moved on) counts as a miss, and at once a release of all its
locks follows it on the same connection (a ``kvcache.connector.lock_release`` span with
``kvcache.abandoned``). Releases and ends of sessions are sent even while the server looks
down: a server that was only frozen or slow reads them when it resumes, right after the
lookups they concern (one connection keeps their order), so the locks and session a late
lookup created go within moments of its answer instead of at their TTLs; a server that is gone
lost them anyway.

With ``defer_releases`` (vLLM's connector), releases and ends of sessions wait in the RPC
client (``RpcClient.defer``) and go in one frame with the next lookup, or at :meth:`flush`
(the connector flushes at the end of ``schedule`` and of ``update_from_output``): one frame
per step where there was one per request, in the same order on the connection. The workers
write on connections of their own, so the server may read their next operations before that
frame; where stores wait (a replay), the flush at the end of a ``schedule`` that gives the
workers stores or loads also waits until the server has applied the frames sent so far, so the
order is the same on every run.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import KW_ONLY, dataclass, field

from connector.mirror import FeedEntry, LookupMirror
from connector.stats import StatsRecorder
from testbed.core import protocol as p
from testbed.core import telemetry
from testbed.core.keys import ChunkHash
from testbed.core.round_trips import RoundTrips
from testbed.core.rpc import RpcClient
from testbed.core.telemetry import SpanKind
from testbed.core.telemetry import attributes as a

log = logging.getLogger(__name__)

MAX_UNREAD = 4096
"""Replies of mirror-answered lookups kept waiting to be read (older ones: their feed is in
later replies too, from the number each asks after)."""
ALL_TOKENS = 1 << 62
"""A token range end beyond any request: a release of every lock of the session."""


@dataclass(frozen=True)
class LookupAnswer:
    hit_chunks: int
    """Complete chunks the server holds and locked (0 when the lookup failed)."""
    handle: bytes = b""
    """The lock group's name (workers release the locks with it)."""
    ok: bool = True
    """False when the server was down, timed out or refused the lookup (a miss)."""
    refused: bool = False
    """The server refused it for a limit or a client quota (``ok`` is False): a limit
    refusal, counted apart from failures."""
    hit_chunks_by_tier: dict[str, int] = field(default_factory=dict)
    """Of ``hit_chunks``, how many each tier held at match time (hit-source name -> chunks;
    empty: all L1's, a server without tiers)."""


@dataclass
class _Lookup:
    future: Future[p.Reply] | None
    """``None`` when the lookup was never sent (the server looked down)."""
    span: telemetry.Span
    started_at: float
    started_ns: int
    """The span's start (wall clock, ns): its duration is exactly what the stats record."""
    num_chunks: int
    parent: str
    polls: int = 0
    answer: LookupAnswer | None = None
    trips: RoundTrips = field(default_factory=RoundTrips)
    """The lookup's and its polls' round trips (a reply not yet taken: the scheduler was
    busy elsewhere)."""


@dataclass(eq=False)
class SchedulerClient:
    rpc: RpcClient
    _: KW_ONLY
    model: str
    world_size: int
    num_readers: int
    chunk_size: int
    poll_interval_s: float = 0.001
    track_evictions: bool = False
    """Lookups ask the server which chunks it removed since the last answer (for vLLM's KV
    events; :meth:`take_evictions`)."""
    eviction_seq: int = 0
    """The server's latest removal number this client knows (``GetConfig`` at start)."""
    defer_releases: bool = False
    mirror: LookupMirror | None = None
    """The lookup mirror (``connector.mirror``): lookups ask for L1's commits and removals, and
    every reply read feeds it, those of lookups nobody waits for included (:meth:`drain`)."""

    def __post_init__(self) -> None:
        self.stats = StatsRecorder()
        """Lookups and abandoned releases for vLLM's connector stats."""
        self._lookups: dict[str, _Lookup] = {}
        self._eviction_epoch = 0
        self._evicted: list[tuple[str, ChunkHash, int]] = []
        self._tier_changes: list[p.TierChange] = []
        self._evictions_lost = False
        self._unread: list[Future[p.Reply]] = []
        """Replies of lookups the mirror answered: read for their feed (:meth:`drain`)."""
        self._mirror_epoch = self.rpc.server_epoch
        """The server instance the mirror's knowledge is of (0: not known yet)."""

    def submit_lookup(
        self,
        session_id: str,
        chunk_hashes: list[ChunkHash],
        *,
        cache_salt: str = "",
        parent: str = "",
        mirror_hit_chunks: int | None = None,
        answered: bool = False,
        engine_hit_tokens: int = 0,
    ) -> None:
        """Starts a lookup for the session (replacing any earlier one). ``mirror_hit_chunks``:
        the mirror's prediction, for the server to check; ``answered``: the mirror's
        prediction is the answer (a miss), settled at once, and the server takes no locks."""
        started_ns = time.time_ns()
        span = telemetry.start_span(
            a.CONNECTOR_LOOKUP,
            kind=SpanKind.CLIENT,
            parent=parent,
            start_time_ns=started_ns,
            attributes={
                a.SESSION_ID: session_id,
                a.CHUNKS_REQUESTED: len(chunk_hashes),
                a.TOKENS_REQUESTED: len(chunk_hashes) * self.chunk_size,
                a.NUM_READERS: self.num_readers,
            },
        )
        future = None
        if self.rpc.alive:
            feed = self.track_evictions or self.mirror is not None
            future = self.rpc.submit(
                p.Lookup(
                    session_id=session_id,
                    model=self.model,
                    world_size=self.world_size,
                    cache_salt=cache_salt,
                    chunk_hashes=chunk_hashes,
                    num_readers=self.num_readers,
                    traceparent=telemetry.traceparent_of(span),
                    evictions_after=self.eviction_seq if feed else None,
                    tier_events=feed,
                    commits=self.mirror is not None,
                    lock=not answered,
                    mirror_hit_chunks=mirror_hit_chunks,
                    engine_hit_tokens=engine_hit_tokens,
                )
            )
        lookup = _Lookup(future, span, time.monotonic(), started_ns, len(chunk_hashes), parent)
        self._lookups[session_id] = lookup
        if mirror_hit_chunks is not None:
            span.set_attribute(a.MIRROR_HIT_CHUNKS, mirror_hit_chunks)
        if answered:
            assert mirror_hit_chunks is not None
            if future is not None:
                self._unread.append(future)
            lookup.future = None
            span.set_attribute(a.MIRROR_ANSWERED, True)
            self._settle(lookup, None, None, mirror_hit_chunks=mirror_hit_chunks)

    def lookup_result(
        self, session_id: str, wait_s: float = 0.0, *, wait_pending: bool = True
    ) -> LookupAnswer | None:
        """The session's lookup answer, or ``None`` while it is outstanding.

        Waits up to ``wait_s`` for the answer. A ``pending`` answer (the next chunk's store is
        in flight) is polled again: within ``wait_s`` when ``wait_pending``, else the poll is
        sent and ``None`` returned at once (its reply is taken at the next call). Failures
        (timeout, dead server, error reply) count as a miss: 0 chunks, ``ok`` False.
        """
        lookup = self._lookups[session_id]
        deadline = time.monotonic() + wait_s
        while lookup.answer is None:
            if lookup.future is None:
                self._settle(lookup, None, "cache server unavailable")
                break
            remaining = deadline - time.monotonic()
            if not lookup.future.done() and remaining <= 0:
                return None
            try:
                reply = lookup.future.result(max(remaining, 0.0) if remaining > 0 else None)
            except TimeoutError:
                return None
            except Exception as exc:  # ServerUnavailable or the client closing
                self._settle(lookup, None, str(exc))
                self._release_abandoned(session_id, lookup)
                break
            lookup.trips.took(lookup.future)
            if isinstance(reply, p.Error):
                refused = reply.code in p.LIMIT_CODES
                self._settle(lookup, None, f"{reply.code}: {reply.message}", refused=refused)
            elif isinstance(reply, p.LookupResult) and reply.pending:
                lookup.polls += 1
                if wait_pending:
                    time.sleep(self.poll_interval_s)
                lookup.future = self.rpc.submit(
                    p.LookupPoll(
                        session_id=session_id, traceparent=telemetry.traceparent_of(lookup.span)
                    )
                )
                if not wait_pending:
                    return None
            else:
                assert isinstance(reply, p.LookupResult)
                self._settle(lookup, reply, None)
        return lookup.answer

    def _settle(
        self,
        lookup: _Lookup,
        reply: p.LookupResult | None,
        error: str | None,
        *,
        refused: bool = False,
        mirror_hit_chunks: int = 0,
    ) -> None:
        hit_chunks = mirror_hit_chunks if reply is None else reply.hit_chunks
        by_tier = {} if reply is None else dict(reply.hit_chunks_by_tier)
        lookup.answer = LookupAnswer(
            hit_chunks,
            b"" if reply is None else reply.handle,
            ok=error is None,
            refused=refused,
            hit_chunks_by_tier=by_tier,
        )
        lookup.span.set_attributes(
            {
                **{
                    a.TOKENS_HIT_BY_SOURCE[s]: n * self.chunk_size
                    for s, n in by_tier.items()
                    if s in a.TOKENS_HIT_BY_SOURCE
                },
                a.CHUNKS_HIT: hit_chunks,
                a.TOKENS_HIT: hit_chunks * self.chunk_size,
                a.LOOKUP_POLLS: lookup.polls,
                a.WAIT_MS: (time.monotonic() - lookup.started_at) * 1e3,
                **lookup.trips.attributes(),
                a.OK: error is None,
            }
        )
        if reply is not None:
            if reply.miss_status:
                lookup.span.set_attribute(a.MISS_STATUS, reply.miss_status)
            self._note_evictions(reply)
        if error is not None:
            what = "refused by the server's limits" if refused else "failed"
            log.warning("lookup %s, treating as a miss: %s", what, error)
            lookup.span.set_attribute(a.ERROR, error)
            telemetry.fail(lookup.span, error)
        ended_ns = time.time_ns()
        lookup.span.end(end_time=ended_ns)
        self.stats.lookup(
            requested_tokens=lookup.num_chunks * self.chunk_size,
            hit_tokens=hit_chunks * self.chunk_size,
            ok=error is None,
            seconds=(ended_ns - lookup.started_ns) / 1e9,
        )

    def _release_abandoned(self, session_id: str, lookup: _Lookup) -> None:
        """The lookup was sent but its answer will not be used: whatever locks it takes when
        the server gets to it are released right after (the next request on the connection)."""
        if lookup.future is not None:
            self.free_locks(session_id, 0, ALL_TOKENS, parent=lookup.parent, abandoned=True)

    def drain(self) -> None:
        """Reads the replies of the lookups the mirror answered that have arrived, for the
        feed they carry, and empties the mirror if the server is another instance than the one
        it learned from (a restart: replies to the old one never come); never waits."""
        epoch = self.rpc.server_epoch
        if self.mirror is not None and epoch and epoch != self._mirror_epoch:
            if self._mirror_epoch:
                self.mirror.forget_all()
                self._unread = []
            self._mirror_epoch = epoch
        unread = []
        for future in self._unread[-MAX_UNREAD:]:
            if not future.done():
                unread.append(future)
                continue
            try:
                reply = future.result(0)
            except Exception:  # the server went down: the heartbeat's concern, not the feed's
                continue
            if isinstance(reply, p.LookupResult):
                self._note_evictions(reply)
        self._unread = unread

    def _note_evictions(self, reply: p.LookupResult) -> None:
        if not self.track_evictions and self.mirror is None:
            return
        restarted = self._eviction_epoch not in (0, reply.epoch)
        self._eviction_epoch = reply.epoch
        lost = reply.evictions_lost or restarted
        if lost and self.track_evictions:
            self._evictions_lost = True
            self._evicted = []
            self._tier_changes = []
        if self.track_evictions:
            self._evicted += [(c.cache_salt, c.chunk_hash, c.seq) for c in reply.evicted]
            self._tier_changes += reply.tier_changes
        if self.mirror is not None:
            if lost:
                self.mirror.forget_all()
            self.mirror.changed(
                [FeedEntry(c.seq, c.cache_salt, c.chunk_hash, False) for c in reply.evicted]
                + [FeedEntry(c.seq, c.cache_salt, c.chunk_hash, True) for c in reply.committed]
            )
            self.mirror.tier_changed(
                (c.cache_salt, c.chunk_hash, c.medium, c.stored) for c in reply.tier_changes
            )
        if lost or reply.eviction_seq > self.eviction_seq:
            self.eviction_seq = reply.eviction_seq

    def take_evictions(self) -> tuple[list[tuple[str, ChunkHash, int]], bool]:
        """Chunks ``(cache salt, chunk hash, removal number)`` the server removed, as the lookups
        answered since the last call learned; and whether removals were lost (the server forgot
        them or restarted: any chunk may be gone)."""
        evicted, lost = self._evicted, self._evictions_lost
        self._evicted, self._evictions_lost = [], False
        return evicted, lost

    def take_tier_changes(self) -> list[p.TierChange]:
        """Chunks committed in or removed from the tiers below L1, as the lookups answered
        since the last call learned (oldest first; emptied when removals were lost)."""
        changes, self._tier_changes = self._tier_changes, []
        return changes

    def forget_lookup(self, session_id: str) -> None:
        lookup = self._lookups.pop(session_id, None)
        if lookup is not None and lookup.answer is None:
            self._settle(lookup, None, "abandoned before the answer arrived")
            self._release_abandoned(session_id, lookup)

    def free_locks(
        self,
        session_id: str,
        start_token: int,
        end_token: int,
        parent: str = "",
        *,
        abandoned: bool = False,
    ) -> None:
        """Releases the session's locks on complete chunks in ``[start, end)``; fire and forget.
        ``abandoned``: the release of a lookup whose answer was not waited for."""
        attributes: dict[str, str | int | bool] = {
            a.SESSION_ID: session_id,
            a.RANGE_START: start_token,
            a.RANGE_END: end_token,
            a.CHUNKS: max(0, end_token // self.chunk_size - -(-start_token // self.chunk_size)),
        }
        if abandoned:
            attributes[a.ABANDONED] = True
            self.stats.abandoned_release()
        with telemetry.traced(
            a.CONNECTOR_LOCK_RELEASE, kind=SpanKind.CLIENT, parent=parent, attributes=attributes
        ) as span:
            self._fire(
                p.FreeLocks(session_id=session_id, start_token=start_token, end_token=end_token),
                span,
            )

    def end_session(self, session_id: str, parent: str = "") -> None:
        """The request finished; fire and forget."""
        self.forget_lookup(session_id)
        with telemetry.traced(
            a.CONNECTOR_END_SESSION,
            kind=SpanKind.CLIENT,
            parent=parent,
            attributes={a.SESSION_ID: session_id},
        ) as span:
            self._fire(p.EndSession(session_id=session_id), span)

    def flush(self, wait_s: float = 0.0) -> None:
        """Sends the deferred releases and ends of sessions now. ``wait_s`` > 0: then waits up
        to that long (while the server answers) until it has applied them, so that the workers'
        operations that follow reach it after them: the unlocks and the recency refreshes of
        the ends of sessions come before the stores whose evictions they decide, whatever the
        machine's timing (a replay's determinism)."""
        self.rpc.flush()
        if wait_s > 0 and self.rpc.alive and not self.rpc.settle_deferred(wait_s):
            log.warning(
                "the cache server did not confirm this step's lock releases within %.1f s; "
                "the workers' operations may reach it first",
                wait_s,
            )

    def _fire(self, request: p.FreeLocks | p.EndSession, span: telemetry.Span) -> None:
        """Sends without waiting, also while the server looks down (see the module docstring).
        ``kvcache.ok``: the server was answering when it was sent."""
        request.traceparent, request.tracestate = telemetry.inject()
        answering = self.rpc.alive
        if self.defer_releases:
            self.rpc.defer(request)
        else:
            self.rpc.submit(request)
        span.set_attribute(a.OK, answering)
        if not answering:
            telemetry.fail(span, "sent while the cache server was not answering")
