"""Connections that do not authenticate: closed after a short time, and never allowed to
take the descriptors authenticated clients need.

Runs in the cache server process, on its loop's thread. ZeroMQ accepts TCP connections by
itself and hides them from the application; :class:`ConnectionGuard` watches them through a
socket monitor (``ACCEPTED`` / ``DISCONNECTED`` / ``CLOSED`` events carry the descriptor) and
learns which connection sent a request from the descriptor ZeroMQ reports per message
(``SRCFD``). A connection becomes *authenticated* with its first request carrying a valid
credential; until then it is *pending*. Pending connections are closed

- when ``auth_timeout_s`` passed since they were accepted, and
- beyond ``max_unauthenticated`` at once (oldest first), so that an idle flood cannot use up
  the descriptor limit (``RLIMIT_NOFILE``, raised to its hard limit at start) while
  authenticated clients keep theirs.

Closing is a ``shutdown()`` of the connection (on a duplicate of ZeroMQ's descriptor, after
checking it still leads to the same peer); ZeroMQ then sees the end of the stream and drops
it. A legitimate client loses nothing: a DEALER reconnects by itself, and ``testbed.core.rpc``
clients send a heartbeat (authenticated) as soon as they connect. Every close is counted
(``unauthenticated_closed``) and logged, at most once per :data:`LOG_INTERVAL_S`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import socket
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger(__name__)

LOG_INTERVAL_S = 10.0
MAX_UNAUTHENTICATED_DEFAULT = 256
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED


@dataclass
class _Pending:
    accepted_at: float
    peer: object


def descriptor_limit() -> int:
    """Raises this process's soft descriptor limit to its hard limit; returns the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def default_max_unauthenticated(limit: int) -> int:
    """A quarter of the descriptor ``limit``, at least 4, at most 256."""
    return max(4, min(MAX_UNAUTHENTICATED_DEFAULT, limit // 4))


class ConnectionGuard:
    """Tracks one ROUTER socket's TCP connections; closes pending ones (see the module)."""

    def __init__(
        self,
        router: zmq.Socket,
        *,
        auth_timeout_s: float,
        max_unauthenticated: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.auth_timeout_s = auth_timeout_s
        self.max_unauthenticated = max_unauthenticated
        self.monitor = router.get_monitor_socket(_EVENTS)
        self._router = router
        self._clock = clock
        self._pending: OrderedDict[int, _Pending] = OrderedDict()
        self._authenticated: set[int] = set()
        self.closed = 0
        """Pending connections closed so far (``unauthenticated_closed``)."""
        self._logged_closed = 0
        self._next_log = 0.0

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def num_authenticated(self) -> int:
        return len(self._authenticated)

    def read_events(self) -> None:
        """Applies every monitor event that has arrived (call when the monitor is readable)."""
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._authenticated.discard(fd)
                self._pending[fd] = _Pending(self._clock(), _peer(fd))
                self._enforce_cap()
            else:  # disconnected or closed: the descriptor may be reused from now on
                self._pending.pop(fd, None)
                self._authenticated.discard(fd)

    def authenticated(self, fd: int | None) -> None:
        """The connection on descriptor ``fd`` sent a request with a valid credential."""
        if fd is None or fd < 0:
            return
        if self._pending.pop(fd, None) is not None or fd not in self._authenticated:
            self._authenticated.add(fd)

    def tick(self) -> None:
        """Closes pending connections older than ``auth_timeout_s``; logs what was closed."""
        deadline = self._clock() - self.auth_timeout_s
        while self._pending:
            fd, pending = next(iter(self._pending.items()))
            if pending.accepted_at > deadline:
                break
            self._close(fd)
        self._log()

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._router.disable_monitor()
        self.monitor.close(0)

    def _enforce_cap(self) -> None:
        while len(self._pending) > self.max_unauthenticated:
            self._close(next(iter(self._pending)))

    def _close(self, fd: int) -> None:
        pending = self._pending.pop(fd)
        try:
            with socket.socket(fileno=os.dup(fd)) as connection:
                if connection.getpeername() != pending.peer:
                    return  # the descriptor was reused: not the connection we meant
                connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            return  # already gone
        self.closed += 1

    def _log(self) -> None:
        now = self._clock()
        if self.closed == self._logged_closed or now < self._next_log:
            return
        log.warning(
            "closed %d connection(s) that sent no authenticated request within %gs or beyond "
            "%d pending at once (%d in total); clients must send the server's token",
            self.closed - self._logged_closed,
            self.auth_timeout_s,
            self.max_unauthenticated,
            self.closed,
        )
        self._logged_closed = self.closed
        self._next_log = now + LOG_INTERVAL_S


def _peer(fd: int) -> object:
    try:
        with socket.socket(fileno=os.dup(fd)) as connection:
            return connection.getpeername()
    except OSError:
        return None


def source_fd(frame: zmq.Frame) -> int | None:
    """The descriptor of the connection a received frame came from (``None``: unknown)."""
    try:
        return int(frame.get(zmq.SRCFD))
    except (zmq.ZMQError, TypeError, ValueError):
        return None
