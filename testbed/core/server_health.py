"""Whether a cache server answers, as this process's clients of it see it.

Liveness is shared by every client of one server URL in a process (:func:`health_of`): once
any of them saw a timeout, the server is *down* for all of them until a heartbeat is answered
again, so callers degrade to "miss and recompute" at once instead of each waiting out its own
timeout; an engine step therefore waits at most one timeout for a dead server. Each outage is
recorded as one ``kvcache.connector.outage`` span, from the first timeout to the first answer
(or to the close of a client while it lasts). Thread-safe: the RPC clients' I/O runs on any
thread.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from testbed.core import telemetry
from testbed.core.telemetry import attributes as a


@dataclass
class ServerHealth:
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


_health: dict[str, ServerHealth] = {}
_health_lock = threading.Lock()


def health_of(url: str) -> ServerHealth:
    """The health of the server at ``url`` that every client of it in this process shares."""
    with _health_lock:
        return _health.setdefault(url, ServerHealth(url))


def _record_outage(url: str, start_ns: int, duration_s: float) -> None:
    span = telemetry.start_span(
        a.CONNECTOR_OUTAGE,
        start_time_ns=start_ns,
        attributes={a.SERVER_URL: url, a.OUTAGE_S: duration_s},
    )
    telemetry.fail(span, f"cache server at {url} did not answer for {duration_s:.3f} s")
    span.end(end_time=start_ns + int(duration_s * 1e9))
