"""Client side of the protocol: a DEALER socket driven by one I/O thread, with futures.

Used by the connector's scheduler and worker clients (and by tools and tests). Callers on any
thread :meth:`RpcClient.submit` a request and get a :class:`concurrent.futures.Future`; the I/O
thread sends it (with the client's credential), matches the reply by ``rid``, fails it with
:class:`ServerUnavailable` when no reply arrives within the timeout, and sends heartbeats so
the server knows the client lives.

Liveness is shared by every client of one server URL in a process: once any of them saw a
timeout, the server is *down* (:attr:`RpcClient.alive` is False) for all of them until a
heartbeat is answered again, so callers degrade to "miss and recompute" at once instead of
each waiting out its own timeout; an engine step therefore waits at most one timeout for a
dead server. Each outage is recorded as one ``kvcache.connector.outage`` span (from the first
timeout to the first answer). Every reply carries the server's epoch; :attr:`server_epoch`
is the latest seen. Nothing here blocks longer than a timeout.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import zmq

from testbed import protocol as p
from testbed import telemetry
from testbed.telemetry import attributes as a

_POLL_MS = 50
_DOWN_PROBE_INTERVAL_S = 0.5


class ServerUnavailable(RuntimeError):
    """The server did not answer in time, or the client is closed."""


class RemoteError(RuntimeError):
    """The server answered with an ``Error`` reply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


@dataclass(frozen=True)
class CurveKeys:
    """A client's ZeroMQ CURVE credentials: its key pair and the server's public key
    (files as written by ``zmq.auth.create_certificates``)."""

    client_secret_file: Path
    server_public_file: Path


@dataclass
class _Health:
    """Whether one server URL answers, shared by this process's clients of it."""

    url: str
    alive: bool = True
    down_since: float | None = None
    down_since_ns: int = 0
    outages: list[tuple[float, float]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def down(self) -> None:
        with self.lock:
            if self.alive:
                self.alive = False
                self.down_since = time.monotonic()
                self.down_since_ns = time.time_ns()

    def up(self) -> None:
        with self.lock:
            if self.alive:
                return
            self.alive = True
            started, started_ns = self.down_since or time.monotonic(), self.down_since_ns
            self.down_since = None
        ended = time.monotonic()
        self.outages.append((started, ended))
        _record_outage(self.url, started_ns, ended - started)

    def record_open_outage(self) -> None:
        """Records an outage still going on (a client closes while the server is down); a later
        answer records only the rest of it."""
        with self.lock:
            if self.alive or self.down_since is None:
                return
            started, started_ns = self.down_since, self.down_since_ns
            self.down_since, self.down_since_ns = time.monotonic(), time.time_ns()
        now = time.monotonic()
        self.outages.append((started, now))
        _record_outage(self.url, started_ns, now - started)

    def outage_s(self) -> float:
        """Seconds the server was down so far (a running outage counts up to now)."""
        total = sum(end - start for start, end in self.outages)
        if self.down_since is not None:
            total += time.monotonic() - self.down_since
        return total


_health: dict[str, _Health] = {}
_health_lock = threading.Lock()


def health_of(url: str) -> _Health:
    with _health_lock:
        return _health.setdefault(url, _Health(url))


def _record_outage(url: str, start_ns: int, duration_s: float) -> None:
    span = telemetry.start_span(
        a.CONNECTOR_OUTAGE,
        start_time_ns=start_ns,
        attributes={a.SERVER_URL: url, a.OUTAGE_S: duration_s},
    )
    telemetry.fail(span, f"cache server at {url} did not answer for {duration_s:.3f} s")
    span.end(end_time=start_ns + int(duration_s * 1e9))


@dataclass
class _Outgoing:
    rid: int
    frame: bytes
    future: Future[p.Reply]
    deadline: float


class RpcClient:
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
        if timeout_s <= 0 or heartbeat_interval_s <= 0:
            raise ValueError("timeout_s and heartbeat_interval_s must be positive")
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
        self._outbox: queue.SimpleQueue[_Outgoing] = queue.SimpleQueue()
        self._wake_read, self._wake_write = os.pipe()
        self._rids = itertools.count(1)
        self._op_ids = itertools.count(1)
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

    def submit(self, request: p.Request, timeout_s: float | None = None) -> Future[p.Reply]:
        """Sends ``request`` (its ``rid`` and credential are set here); the future holds the
        reply. It fails with :class:`ServerUnavailable` after ``timeout_s`` (default: the
        client's) without a reply. ``Error`` replies are returned, not raised."""
        future: Future[p.Reply] = Future()
        if self._closed.is_set():
            future.set_exception(ServerUnavailable("client is closed"))
            return future
        request.rid = next(self._rids)
        if not isinstance(request, p.Ping):
            request.auth = self.token
        now = time.monotonic()
        future.sent_at = now  # type: ignore[attr-defined]  # timing: the span's server_ms
        self._outbox.put(
            _Outgoing(request.rid, p.encode(request), future, now + (timeout_s or self.timeout_s))
        )
        os.write(self._wake_write, b"x")
        return future

    def call(self, request: p.Request, timeout_s: float | None = None) -> p.Reply:
        """Sends and waits; raises :class:`RemoteError` for an ``Error`` reply."""
        timeout = timeout_s or self.timeout_s
        try:
            reply = self.submit(request, timeout).result(timeout + 5.0)
        except TimeoutError:  # the I/O thread is gone; should not happen
            raise ServerUnavailable("no reply and no timeout from the I/O thread") from None
        return check(reply)

    def fire(self, request: p.Request) -> None:
        """Sends without waiting for the reply (it is dropped when it comes)."""
        self.submit(request)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self.health.record_open_outage()
        self._closed.set()
        os.write(self._wake_write, b"x")
        self._thread.join(5.0)
        os.close(self._wake_read)
        os.close(self._wake_write)

    def __enter__(self) -> RpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -----------------------------------------------------------------------------------------
    # I/O thread
    # -----------------------------------------------------------------------------------------

    def _socket(self) -> zmq.Socket:
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

    def _run(self) -> None:
        socket = self._socket()
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        poller.register(self._wake_read, zmq.POLLIN)
        waiting: dict[int, _Outgoing] = {}  # sent, awaiting a reply
        unsent: list[_Outgoing] = []  # not connected yet: retried until their deadline
        next_heartbeat = time.monotonic() + self.heartbeat_interval_s
        try:
            while not self._closed.is_set():
                timeout = 5 if unsent else _POLL_MS
                for sock, _ in poller.poll(timeout):
                    if sock == self._wake_read:
                        os.read(self._wake_read, 4096)
                    else:
                        self._receive(socket, waiting)
                while True:
                    try:
                        unsent.append(self._outbox.get_nowait())
                    except queue.Empty:
                        break
                now = time.monotonic()
                if not self.health.alive:  # probe often while the server is down
                    next_heartbeat = min(next_heartbeat, now + _DOWN_PROBE_INTERVAL_S)
                if now >= next_heartbeat:
                    unsent.append(self._heartbeat(now))
                    next_heartbeat = now + self.heartbeat_interval_s
                unsent = self._send(socket, unsent, waiting)
                self._expire(now, unsent, waiting)
        finally:
            socket.close(0)
            for out in [*unsent, *waiting.values()]:
                _fail(out.future, ServerUnavailable("client closed before the reply arrived"))
            while True:
                try:
                    _fail(self._outbox.get_nowait().future, ServerUnavailable("client is closed"))
                except queue.Empty:
                    break

    def _heartbeat(self, now: float) -> _Outgoing:
        rid = next(self._rids)
        future: Future[p.Reply] = Future()
        frame = p.encode(p.Heartbeat(rid=rid, auth=self.token))
        return _Outgoing(rid, frame, future, now + self.timeout_s)

    def _send(
        self, socket: zmq.Socket, unsent: list[_Outgoing], waiting: dict[int, _Outgoing]
    ) -> list[_Outgoing]:
        for index, out in enumerate(unsent):
            try:
                socket.send(out.frame, zmq.NOBLOCK)
            except zmq.Again:
                return unsent[index:]
            waiting[out.rid] = out
        return []

    def _receive(self, socket: zmq.Socket, waiting: dict[int, _Outgoing]) -> None:
        while True:
            try:
                frame = socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                reply = p.decode_reply(frame)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue  # not ours to interpret; the request will time out
            self.health.up()
            if reply.epoch:
                self.server_epoch = reply.epoch
            out = waiting.pop(reply.rid, None)
            if out is not None and not out.future.done():
                out.future.arrived_at = time.monotonic()  # type: ignore[attr-defined]
                out.future.set_result(reply)

    def _expire(self, now: float, unsent: list[_Outgoing], waiting: dict[int, _Outgoing]) -> None:
        expired = [out for out in unsent if out.deadline <= now]
        expired += [out for out in waiting.values() if out.deadline <= now]
        for out in expired:
            waiting.pop(out.rid, None)
            if out in unsent:
                unsent.remove(out)
            self.health.down()
            _fail(
                out.future,
                ServerUnavailable(
                    f"no reply from the cache server at {self.url} within the timeout; is it "
                    f"running? (start one with `kvtb server`)"
                ),
            )


def check(reply: p.Reply) -> p.Reply:
    """``reply``, or :class:`RemoteError` if it is an ``Error``."""
    if isinstance(reply, p.Error):
        raise RemoteError(reply.code, reply.message)
    return reply


def _fail(future: Future[p.Reply], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


def reply_timing(future: Future[p.Reply] | None) -> tuple[float, float]:
    """(seconds from sending a request to its reply's arrival, seconds the reply has waited
    since for the caller to take it): a span's ``server_ms`` and ``poll_wait_ms``."""
    sent = getattr(future, "sent_at", None)
    arrived = getattr(future, "arrived_at", None)
    if sent is None or arrived is None:
        return 0.0, 0.0
    return arrived - sent, max(0.0, time.monotonic() - arrived)
