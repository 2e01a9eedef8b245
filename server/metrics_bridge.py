"""How a scrape of the metrics endpoint (``server.metrics``, an HTTP thread) reads the server's
stats without racing the server's loop, the only thread that touches its state: the scrape asks
and waits, the loop answers between two batches of requests.

Imports nothing but the protocol, so that the loop holds a bridge whether or not the endpoint
(and ``prometheus_client``) is in use; unasked, :meth:`StatsBridge.answer` costs one check.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from testbed.core import protocol as p


class StatsBridge:
    """Hands the loop's :class:`~testbed.core.protocol.ServerStats` to the HTTP thread:
    :meth:`read` (HTTP thread) asks and waits; :meth:`answer` (the loop) answers if asked."""

    def __init__(self, timeout_s: float = 5.0) -> None:
        self.timeout_s = timeout_s
        self._asked = threading.Event()
        self._answered = threading.Event()
        self._one_at_a_time = threading.Lock()
        self._stats: p.ServerStats | None = None

    def read(self) -> p.ServerStats | None:
        """The loop's stats now; ``None`` if the loop did not answer within ``timeout_s``."""
        with self._one_at_a_time:
            self._answered.clear()
            self._asked.set()
            if not self._answered.wait(self.timeout_s):
                self._asked.clear()
                return None
            return self._stats

    def answer(self, stats: Callable[[], p.ServerStats]) -> None:
        """Called by the loop on each pass: reads ``stats()`` when a scrape waits for it."""
        if self._asked.is_set():
            self._asked.clear()
            self._stats = stats()
            self._answered.set()
