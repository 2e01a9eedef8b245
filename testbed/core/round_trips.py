"""Where an operation's round trips to the cache server went, from the client's and the
server's clocks.

A client operation (a lookup and its polls; a store's begin and commit; a retrieve) sends one
or more requests. For each, the client knows when it sent it (``RpcFuture.sent_at``), when it
read the reply off its socket (``arrived_at``) and when the caller took it; the server stamps
each reply with when it read the request (``received_ns``) and when it sent the reply
(``replied_ns``), on its ``CLOCK_MONOTONIC``. On one host that is the client's clock too, so a
round trip splits into

- **request transit**: sent → the server read it (the network, and the request's wait in the
  server's queue behind other clients' work);
- **handler**: read → reply sent (the server's work, a pending lookup's wait for a store or a
  prefetch included);
- **reply read**: reply sent → read off the client's socket (the network back, and the time
  until the client looked: a reply is read when the caller asks, or by the client's
  background thread);

and then **poll wait**: read → taken by the caller. A reply without stamps (an older server,
a refusal) or whose stamps do not fall between the client's own times (another host's clock)
adds only to the round trip; :attr:`RoundTrips.stamped` counts those that split.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from testbed.core.telemetry import attributes as a


@dataclass
class RoundTrips:
    """The round trips of one operation, summed over its requests (seconds)."""

    server_s: float = 0.0
    """Sent → reply read off the socket (every round trip): span ``kvcache.server_ms``."""
    poll_wait_s: float = 0.0
    """Reply read → taken by the caller: ``kvcache.poll_wait_ms``."""
    request_transit_s: float = 0.0
    """Sent → the server read it, over the stamped replies: ``kvcache.rpc.request_transit_ms``."""
    handler_s: float = 0.0
    """The server's read → its reply sent, over the stamped replies: ``kvcache.rpc.handler_ms``."""
    reply_read_s: float = 0.0
    """Reply sent → read here, over the stamped replies: ``kvcache.rpc.reply_read_ms``."""
    stamped: int = 0
    """Replies whose round trip was split (the three figures above cover these only)."""

    def took(self, future: Future[Any] | None) -> None:
        """Adds the round trip of the reply ``future`` holds (nothing for a future never sent
        or never answered)."""
        sent = getattr(future, "sent_at", None)
        arrived = getattr(future, "arrived_at", None)
        if sent is None or arrived is None:
            return
        self.server_s += arrived - sent
        self.poll_wait_s += max(0.0, time.monotonic() - arrived)
        received = getattr(future, "received_ns", 0) / 1e9
        replied = getattr(future, "replied_ns", 0) / 1e9
        if received and replied and sent <= received <= replied <= arrived:
            self.request_transit_s += received - sent
            self.handler_s += replied - received
            self.reply_read_s += arrived - replied
            self.stamped += 1

    def attributes(self) -> dict[str, float]:
        """The span attributes (ms): the round trip and poll wait; its split where a reply
        was stamped."""
        attributes = {a.SERVER_MS: self.server_s * 1e3, a.POLL_WAIT_MS: self.poll_wait_s * 1e3}
        if self.stamped:
            attributes[a.REQUEST_TRANSIT_MS] = self.request_transit_s * 1e3
            attributes[a.HANDLER_MS] = self.handler_s * 1e3
            attributes[a.REPLY_READ_MS] = self.reply_read_s * 1e3
        return attributes
