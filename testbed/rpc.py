"""Client side of the protocol: a DEALER socket driven by one I/O thread, with futures.

Used by the connector's scheduler and worker clients (and by tools and tests). Callers on any
thread :meth:`RpcClient.submit` a request and get a :class:`concurrent.futures.Future`; the I/O
thread sends it, matches the reply by ``rid``, fails it with :class:`ServerUnavailable` when
no reply arrives within the timeout, and sends heartbeats so the server knows the client lives.

A client that saw a timeout marks the server *down* (:attr:`RpcClient.alive` is False) until a
heartbeat is answered again; callers use that to degrade to "miss and recompute" at once
instead of waiting for a timeout per request. Nothing here blocks longer than a timeout.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass

import msgspec
import zmq

from testbed import protocol as p

_POLL_MS = 50
_DOWN_PROBE_INTERVAL_S = 0.5


class ServerUnavailable(RuntimeError):
    """The server did not answer in time, or the client is closed."""


class RemoteError(RuntimeError):
    """The server answered with an ``Error`` reply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


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
        timeout_s: float = 5.0,
        heartbeat_interval_s: float = 10.0,
        context: zmq.Context | None = None,
    ) -> None:
        if timeout_s <= 0 or heartbeat_interval_s <= 0:
            raise ValueError("timeout_s and heartbeat_interval_s must be positive")
        self.url = url
        self.timeout_s = timeout_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.identity = f"{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}".encode()
        self._context = context or zmq.Context.instance()
        self._outbox: queue.SimpleQueue[_Outgoing] = queue.SimpleQueue()
        self._wake_read, self._wake_write = os.pipe()
        self._rids = itertools.count(1)
        self._alive = True
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvtb-rpc-{role}", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """False after a timeout, until the server answers a heartbeat again."""
        return self._alive and not self._closed.is_set()

    def submit(self, request: p.Request, timeout_s: float | None = None) -> Future[p.Reply]:
        """Sends ``request`` (its ``rid`` is assigned here); the future holds the reply.

        The future fails with :class:`ServerUnavailable` after ``timeout_s`` (default: the
        client's) without a reply. ``Error`` replies are returned, not raised.
        """
        future: Future[p.Reply] = Future()
        if self._closed.is_set():
            future.set_exception(ServerUnavailable("client is closed"))
            return future
        request.rid = next(self._rids)
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        self._outbox.put(_Outgoing(request.rid, p.encode(request), future, deadline))
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

    def close(self) -> None:
        if self._closed.is_set():
            return
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

    def _run(self) -> None:
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.IDENTITY, self.identity)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.IMMEDIATE, 1)  # never queue for a server that is not connected
        socket.connect(self.url)
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
                if now >= next_heartbeat:
                    unsent.append(self._heartbeat(now))
                    interval = self.heartbeat_interval_s if self._alive else _DOWN_PROBE_INTERVAL_S
                    next_heartbeat = now + min(interval, self.heartbeat_interval_s)
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
        frame = p.encode(p.Heartbeat(rid=rid))
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
            self._alive = True
            out = waiting.pop(reply.rid, None)
            if out is not None and not out.future.done():
                out.future.set_result(reply)

    def _expire(self, now: float, unsent: list[_Outgoing], waiting: dict[int, _Outgoing]) -> None:
        expired = [out for out in unsent if out.deadline <= now]
        expired += [out for out in waiting.values() if out.deadline <= now]
        for out in expired:
            waiting.pop(out.rid, None)
            if out in unsent:
                unsent.remove(out)
            self._alive = False
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
