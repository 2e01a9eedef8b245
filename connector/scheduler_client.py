"""Scheduler-side client: non-blocking lookups, lock release, end of session.

Runs in vLLM's scheduler process. :meth:`SchedulerClient.submit_lookup` returns at once;
:meth:`SchedulerClient.lookup_result` is polled (``None`` while the answer is outstanding).
Each operation leaves a CLIENT span whose context travels in the request, so the server's
span is its child. A dead or missing server never blocks the caller: once the RPC client has
marked the server down, lookups answer 0 at once and frees are dropped (the server's lock TTL
covers them).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass

from testbed import protocol as p
from testbed import telemetry
from testbed.rpc import RpcClient, reply_timing
from testbed.telemetry import SpanKind
from testbed.telemetry import attributes as a

log = logging.getLogger(__name__)


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


@dataclass
class _Lookup:
    future: Future[p.Reply] | None
    span: telemetry.Span
    started_at: float
    num_chunks: int
    polls: int = 0
    answer: LookupAnswer | None = None
    server_s: float = 0.0
    """Sending each request (lookup, polls) to its reply's arrival, summed."""
    poll_wait_s: float = 0.0
    """Replies arrived but not yet taken (the scheduler was busy elsewhere), summed."""

    def took(self, future: Future[p.Reply]) -> None:
        server_s, waited_s = reply_timing(future)
        self.server_s += server_s
        self.poll_wait_s += waited_s


class SchedulerClient:
    def __init__(
        self,
        rpc: RpcClient,
        *,
        model: str,
        world_size: int,
        num_readers: int,
        chunk_size: int,
        poll_interval_s: float = 0.001,
    ) -> None:
        self.rpc = rpc
        self.model = model
        self.world_size = world_size
        self.num_readers = num_readers
        self.chunk_size = chunk_size
        self.poll_interval_s = poll_interval_s
        self._lookups: dict[str, _Lookup] = {}

    def submit_lookup(
        self,
        session_id: str,
        chunk_hashes: list[bytes],
        *,
        cache_salt: str = "",
        parent: str = "",
    ) -> None:
        """Starts a lookup for the session (replacing any earlier one)."""
        span = telemetry.start_span(
            a.CONNECTOR_LOOKUP,
            kind=SpanKind.CLIENT,
            parent=parent,
            attributes={
                a.SESSION_ID: session_id,
                a.CHUNKS_REQUESTED: len(chunk_hashes),
                a.TOKENS_REQUESTED: len(chunk_hashes) * self.chunk_size,
                a.NUM_READERS: self.num_readers,
            },
        )
        future = None
        if self.rpc.alive:
            future = self.rpc.submit(
                p.Lookup(
                    session_id=session_id,
                    model=self.model,
                    world_size=self.world_size,
                    cache_salt=cache_salt,
                    chunk_hashes=chunk_hashes,
                    num_readers=self.num_readers,
                    traceparent=telemetry.traceparent_of(span),
                )
            )
        self._lookups[session_id] = _Lookup(future, span, time.monotonic(), len(chunk_hashes))

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
                break
            lookup.took(lookup.future)
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
    ) -> None:
        hit_chunks = 0 if reply is None else reply.hit_chunks
        lookup.answer = LookupAnswer(
            hit_chunks, b"" if reply is None else reply.handle, ok=error is None, refused=refused
        )
        lookup.span.set_attributes(
            {
                a.CHUNKS_HIT: hit_chunks,
                a.TOKENS_HIT: hit_chunks * self.chunk_size,
                a.LOOKUP_POLLS: lookup.polls,
                a.WAIT_MS: (time.monotonic() - lookup.started_at) * 1e3,
                a.SERVER_MS: lookup.server_s * 1e3,
                a.POLL_WAIT_MS: lookup.poll_wait_s * 1e3,
                a.OK: error is None,
            }
        )
        if reply is not None and reply.miss_status:
            lookup.span.set_attribute(a.MISS_STATUS, reply.miss_status)
        if error is not None:
            what = "refused by the server's limits" if refused else "failed"
            log.warning("lookup %s, treating as a miss: %s", what, error)
            lookup.span.set_attribute(a.ERROR, error)
            telemetry.fail(lookup.span, error)
        lookup.span.end()

    def forget_lookup(self, session_id: str) -> None:
        lookup = self._lookups.pop(session_id, None)
        if lookup is not None and lookup.answer is None:
            self._settle(lookup, None, "abandoned before the answer arrived")

    def free_locks(
        self, session_id: str, start_token: int, end_token: int, parent: str = ""
    ) -> None:
        """Releases the session's locks on complete chunks in ``[start, end)``; fire and forget."""
        with telemetry.traced(
            a.CONNECTOR_LOCK_RELEASE,
            kind=SpanKind.CLIENT,
            parent=parent,
            attributes={
                a.SESSION_ID: session_id,
                a.RANGE_START: start_token,
                a.RANGE_END: end_token,
                a.CHUNKS: max(0, end_token // self.chunk_size - -(-start_token // self.chunk_size)),
            },
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

    def _fire(self, request: p.FreeLocks | p.EndSession, span: telemetry.Span) -> None:
        if not self.rpc.alive:
            telemetry.fail(span, "cache server unavailable; the server's TTLs will clean up")
            span.set_attribute(a.OK, False)
            return
        request.traceparent, request.tracestate = telemetry.inject()
        self.rpc.submit(request)
        span.set_attribute(a.OK, True)
