"""Client side of the protocol: a DEALER socket, futures, timeouts and heartbeats.

Used by the connector's scheduler and worker clients (and by tools and tests). Callers on any
thread :meth:`RpcClient.submit` a request and get a future; the reply is matched by ``rid``,
the future fails with :class:`ServerUnavailable` when no reply arrives within the timeout, and
heartbeats tell the server the client lives.

The caller's own thread does the I/O: ``submit`` sends at once, and asking a future (``done``,
``result``) reads the replies that have arrived, waiting in ZeroMQ's poll (without the GIL)
when it must wait. Nothing depends on another Python thread getting the GIL: in vLLM's
processes the engine loop holds it almost all the time, and a reply handed over by a
background thread arrived one GIL switch interval (5 ms) late per hop, twice per round trip.
A background thread, holding the socket only briefly, sends heartbeats, retries requests not
yet sendable, expires timed-out ones and reads replies nobody asks for. Every use of the socket
is under one lock.

Fire-and-forget requests may be *deferred* (:meth:`RpcClient.defer`): they wait in the client
and go in the same frame as its next request (a :class:`~testbed.core.protocol.Batch`), or at
:meth:`RpcClient.flush`, so the server sees every request in the order it was made while a
scheduler step sends one frame where it made several requests.

Liveness is shared by every client of one server URL in a process
(:mod:`testbed.core.server_health`): once any of them saw a timeout, the server is *down*
(:attr:`RpcClient.alive` is False) for all of them until a heartbeat is answered again. Every
reply carries the server's epoch; :attr:`server_epoch` is the latest seen. Nothing here blocks
longer than a timeout.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import msgspec
import zmq

from testbed.core import protocol as p
from testbed.core.closing import Closing
from testbed.core.round_trips import RoundTrips
from testbed.core.server_health import health_of

_IDLE_S = 0.05
"""The background thread's period when nothing is outstanding."""
_BUSY_S = 0.005
"""Its period while requests are outstanding (replies nobody asks for, expiry)."""
_WAIT_SLICE_S = 0.005
"""A waiting caller polls the socket in slices this long (the lock is free in between)."""
_DOWN_PROBE_INTERVAL_S = 0.5


class ServerUnavailable(RuntimeError):
    """The server did not answer in time, or the client is closed."""


class RemoteError(RuntimeError):
    """The server answered with an ``Error`` reply."""

    def __init__(self, code: p.ErrorCode, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


@dataclass(frozen=True)
class CurveKeys:
    """A client's ZeroMQ CURVE credentials: its key pair and the server's public key
    (files as written by ``zmq.auth.create_certificates``)."""

    client_secret_file: Path
    server_public_file: Path


class RpcFuture(Future[p.Reply]):
    """A reply to come. Asking it (``done``, ``result``, ``exception``) first reads the replies
    that have arrived on its client's socket, in the asking thread."""

    def __init__(self, client: RpcClient | None) -> None:
        super().__init__()
        self._client = client
        self.sent_at: float | None = None
        """When the request was handed to the socket (timing: a span's ``server_ms``)."""
        self.arrived_at: float | None = None
        """When its reply was read off the socket."""
        self.received_ns = 0
        self.replied_ns = 0
        """The server's stamps on the reply (``testbed.core.round_trips``)."""

    def done(self) -> bool:
        if not super().done() and self._client is not None:
            self._client._pump(0.0)
        return super().done()

    def result(self, timeout: float | None = None) -> p.Reply:
        return super().result(self._wait(timeout))

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return super().exception(self._wait(timeout))

    def _wait(self, timeout: float | None) -> float | None:
        """Reads replies until this one is in or ``timeout`` passed; returns what is left of
        the timeout for the plain wait (0 once done or expired; the rest once the client is
        closing, which fails its futures itself)."""
        client = self._client
        deadline = None if timeout is None else time.monotonic() + timeout
        while client is not None and not super().done():
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                client._pump(0.0)
                return 0.0
            slice_s = _WAIT_SLICE_S if remaining is None else min(remaining, _WAIT_SLICE_S)
            if not client._pump(slice_s):
                return remaining
        return 0.0


@dataclass
class _Outgoing:
    rid: int
    frame: bytes
    future: Future[p.Reply]
    deadline: float


class RpcClient(Closing):
    """One connection to a cache server. Thread-safe; context manager."""

    def __init__(
        self,
        url: str,
        *,
        role: str = "client",
        token: str = "",
        timeout_s: float = 5.0,
        heartbeat_interval_s: float = 10.0,
        context: zmq.Context | None = None,
        curve: CurveKeys | None = None,
    ) -> None:
        if not (0 < timeout_s < math.inf and 0 < heartbeat_interval_s < math.inf):
            raise ValueError("timeout_s and heartbeat_interval_s must be finite and positive")
        if not url.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(
                f"cache server URL {url!r} is not a ZeroMQ endpoint; use e.g. tcp://127.0.0.1:5555"
            )
        self.url = url
        self.role = role
        self.token = token
        self.timeout_s = timeout_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.health = health_of(url)
        self.server_epoch = 0
        """The epoch of the latest reply (0 before any)."""
        self._curve = curve
        self._context = context or zmq.Context.instance()
        self._lock = threading.Lock()
        """Guards the socket and the request tables below (any thread may do the I/O)."""
        self._socket = self._open_socket()
        self._waiting: dict[int, _Outgoing] = {}  # sent, awaiting a reply
        self._deferred: list[p.Request] = []  # fire-and-forget, sent with the next request
        self._carried: list[Future[p.Reply]] = []  # frames that carried deferred ones, unanswered
        self._unsent: list[_Outgoing] = []  # not connected yet: retried until their deadline
        self._rids = itertools.count(1)
        self._op_ids = itertools.count(1)
        # The first heartbeat goes at once, ahead of any request: a server closes connections
        # that send no authenticated request soon after they connect (``server.connections``),
        # and once a request is answered, so is it (the server answers in order).
        now = time.monotonic()
        self._unsent.append(self._heartbeat(now))
        self._next_heartbeat = now + heartbeat_interval_s
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvtb-rpc-{role}", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """False after a timeout (of any client of this server in the process), until the
        server answers again."""
        return self.health.alive and not self._closed.is_set()

    def new_op_id(self) -> int:
        """A fresh operation id for a store or retrieve of this connection."""
        return next(self._op_ids)

    def submit(self, request: p.Request, timeout_s: float | None = None) -> RpcFuture:
        """Sends ``request`` (its ``rid`` and credential are set here) from this thread; the
        future holds the reply. It fails with :class:`ServerUnavailable` after ``timeout_s``
        (default: the client's) without a reply. ``Error`` replies are returned, not raised."""
        future = RpcFuture(self)
        if self._closed.is_set():
            future.set_exception(ServerUnavailable("client is closed"))
            return future
        self._stamp(request)
        with self._lock:
            if self._closed.is_set():
                future.set_exception(ServerUnavailable("client is closed"))
                return future
            self._queue(request, future, timeout_s)
        return future

    def defer(self, request: p.Request) -> None:
        """Queues a fire-and-forget ``request`` (its reply is dropped): it goes in one frame
        with the next request submitted, or at :meth:`flush`."""
        self._stamp(request)
        with self._lock:
            if not self._closed.is_set():
                self._deferred.append(request)

    def flush(self) -> None:
        """Sends the deferred requests now (one frame)."""
        with self._lock:
            if self._deferred and not self._closed.is_set():
                self._queue(None, RpcFuture(self), None)

    def settle_deferred(self, timeout_s: float) -> bool:
        """Waits up to ``timeout_s`` until the server has answered every frame that carried
        deferred requests (sent so far: :meth:`flush` first), so that it has applied them; what
        another connection sends next reaches it after them. True when all are answered (a
        failed one counts: the server is gone, or did not answer within the client's timeout)."""
        with self._lock:
            carried = [f for f in self._carried if not Future.done(f)]
            self._carried = []
        deadline = time.monotonic() + timeout_s
        for future in carried:
            try:
                future.exception(max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                with self._lock:  # still unanswered: kept for the next wait
                    self._carried = [f for f in carried if not Future.done(f)] + self._carried
                return False
        return True

    def _stamp(self, request: p.Request) -> None:
        request.rid = next(self._rids)
        if not isinstance(request, p.Ping):
            request.auth = self.token

    def _queue(
        self, request: p.Request | None, future: Future[p.Reply], timeout_s: float | None
    ) -> None:
        """Sends ``request`` after the deferred ones, all in one frame (under the lock);
        ``None``: the deferred ones alone (``future`` stands for the last of them)."""
        batch = [*self._deferred, *([request] if request is not None else [])]
        if self._deferred:
            self._carried = [f for f in self._carried if not Future.done(f)]
            self._carried.append(future)
        self._deferred = []
        message: p.Request | p.Batch = batch[0]
        if len(batch) > 1:
            message = p.Batch(requests=batch, auth=self.token, rid=batch[-1].rid)
        now = time.monotonic()
        if isinstance(future, RpcFuture):
            future.sent_at = now
        deadline = now + (timeout_s or self.timeout_s)
        self._unsent.append(_Outgoing(batch[-1].rid, p.encode(message), future, deadline))
        self._flush()

    def call(
        self, request: p.Request, timeout_s: float | None = None, trips: RoundTrips | None = None
    ) -> p.Reply:
        """Sends and waits; raises :class:`RemoteError` for an ``Error`` reply. ``trips``: where
        its round trip is added once answered."""
        timeout = timeout_s or self.timeout_s
        future = self.submit(request, timeout)
        try:
            reply = future.result(timeout + 5.0)
        except TimeoutError:  # the expiry did not run; should not happen
            raise ServerUnavailable("no reply and no timeout from the client") from None
        finally:
            if trips is not None:
                trips.took(future)
        return check(reply)

    def fire(self, request: p.Request) -> None:
        """Sends without waiting for the reply (it is dropped when it comes)."""
        self.submit(request)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self.flush()
        self.health.record_open_outage()
        self._closed.set()
        self._thread.join(5.0)
        with self._lock:
            self._socket.close(0)
            outstanding = [*self._unsent, *self._waiting.values()]
            self._unsent, self._waiting = [], {}
        for out in outstanding:
            _fail(out.future, ServerUnavailable("client closed before the reply arrived"))

    # -----------------------------------------------------------------------------------------
    # I/O (under the lock, on whichever thread asks)
    # -----------------------------------------------------------------------------------------

    def _open_socket(self) -> zmq.Socket:
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.IMMEDIATE, 1)  # never queue for a server that is not connected
        if self._curve is not None:
            from zmq.auth import load_certificate

            public, secret = load_certificate(self._curve.client_secret_file)
            server_public, _ = load_certificate(self._curve.server_public_file)
            socket.curve_secretkey = secret
            socket.curve_publickey = public
            socket.curve_serverkey = server_public
        socket.connect(self.url)
        return socket

    def _pump(self, wait_s: float) -> bool:
        """Sends what could not be sent yet and reads every reply that has arrived, first
        waiting up to ``wait_s`` for one (in ZeroMQ's poll, without the GIL). False once the
        client is closed."""
        with self._lock:
            if self._socket.closed:
                return False
            if self._unsent:
                self._flush()
            if wait_s > 0 and self._waiting:
                self._socket.poll(max(1, int(wait_s * 1000)), zmq.POLLIN)
            self._receive()
        return True

    def _flush(self) -> None:
        sent = 0
        for out in self._unsent:
            try:
                self._socket.send(out.frame, zmq.NOBLOCK)
            except zmq.Again:  # not connected (yet): the background thread retries
                break
            self._waiting[out.rid] = out
            sent += 1
        if sent:
            del self._unsent[:sent]

    def _receive(self) -> None:
        while True:
            try:
                frame = self._socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                message = p.decode_reply(frame)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue  # not ours to interpret; the request will time out
            self.health.up()
            replies = message.replies if isinstance(message, p.Replies) else [message]
            for reply in replies:
                self._deliver(reply)

    def _deliver(self, reply: p.Reply) -> None:
        if reply.epoch:
            self.server_epoch = reply.epoch
        out = self._waiting.pop(reply.rid, None)
        if out is not None and not Future.done(out.future):  # not the pumping done()
            if isinstance(out.future, RpcFuture):
                out.future.arrived_at = time.monotonic()
                out.future.received_ns = reply.received_ns
                out.future.replied_ns = reply.replied_ns
            out.future.set_result(reply)

    # -----------------------------------------------------------------------------------------
    # Background thread: heartbeats, retries, expiry, replies nobody asks for
    # -----------------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._closed.wait(_BUSY_S if self._waiting or self._unsent else _IDLE_S):
            with self._lock:
                if self._closed.is_set():
                    break
                now = time.monotonic()
                if not self.health.alive:  # probe often while the server is down
                    self._next_heartbeat = min(self._next_heartbeat, now + _DOWN_PROBE_INTERVAL_S)
                if now >= self._next_heartbeat:
                    self._unsent.append(self._heartbeat(now))
                    self._next_heartbeat = now + self.heartbeat_interval_s
                self._flush()
                self._receive()
                expired = self._expire(now)
            for out in expired:
                self.health.down()
                _fail(
                    out.future,
                    ServerUnavailable(
                        f"no reply from the cache server at {self.url} within the timeout; is "
                        f"it running? (start one with `kvtb server`)"
                    ),
                )

    def _heartbeat(self, now: float) -> _Outgoing:
        rid = next(self._rids)
        future: Future[p.Reply] = Future()
        frame = p.encode(p.Heartbeat(rid=rid, auth=self.token))
        return _Outgoing(rid, frame, future, now + self.timeout_s)

    def _expire(self, now: float) -> list[_Outgoing]:
        expired = [out for out in self._unsent if out.deadline <= now]
        expired += [out for out in self._waiting.values() if out.deadline <= now]
        for out in expired:
            self._waiting.pop(out.rid, None)
            if out in self._unsent:
                self._unsent.remove(out)
        return expired


def check(reply: p.Reply) -> p.Reply:
    """``reply``, or :class:`RemoteError` if it is an ``Error``."""
    if isinstance(reply, p.Error):
        raise RemoteError(reply.code, reply.message)
    return reply


def _fail(future: Future[p.Reply], exc: BaseException) -> None:
    if not Future.done(future):
        future.set_exception(exc)
