"""The tiers' I/O thread: reads, writes and removals on lower-tier stores, off the server loop.

Runs in the cache server process. The server's loop (single-threaded, owner of the index) submits
:class:`TierJob` s and collects them once done (:meth:`TierIO.completed`); the thread only calls
the stores (each store is touched by this thread alone, one call at a time) and fills a job's
outcome, so no index state is shared between threads. Jobs run in submission order, so a read
submitted after a write of the same key sees its bytes.

``delay_s`` adds that long to every job (a slow device, for fault scenarios: documented as
``--tier-delay``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from server.tiers.base import FailureCause, LowerTierStore
from testbed.core.keys import ChunkHash

JobKind = Literal["read", "write", "remove"]


@dataclass(eq=False)
class TierJob:
    kind: JobKind
    tier: int
    """Index of the tier below L1 (0: L2)."""
    key: ChunkHash
    data: bytes | None = None
    """``write``: the framed bytes to write; ``read``: the bytes read (``None``: failed)."""
    context: Any = None
    """What the submitter needs back (the hierarchy's record of the operation)."""
    ok: bool = False
    cause: FailureCause | None = None
    submitted_at: float = 0.0
    started_at: float = 0.0
    ended_at: float = 0.0


class TierIO:
    """Context manager: one daemon thread over ``stores`` (closed with it)."""

    def __init__(self, stores: Sequence[LowerTierStore], delay_s: float = 0.0) -> None:
        self.stores = list(stores)
        self.delay_s = delay_s
        self.in_flight = 0
        self._todo: queue.SimpleQueue[TierJob | None] = queue.SimpleQueue()
        self._done: deque[TierJob] = deque()
        self._thread = threading.Thread(target=self._run, name="kvtb-tiers", daemon=True)
        self._thread.start()

    def submit(self, job: TierJob) -> None:
        job.submitted_at = time.monotonic()
        self.in_flight += 1
        self._todo.put(job)

    def completed(self) -> list[TierJob]:
        """The jobs done since the last call, in the order they were done."""
        done = []
        while self._done:
            done.append(self._done.popleft())
        self.in_flight -= len(done)
        return done

    def wait_idle(self, timeout_s: float) -> bool:
        """Waits (bounded) until every job submitted has run; True if they have."""
        deadline = time.monotonic() + timeout_s
        while self.in_flight - len(self._done) > 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        return self.in_flight - len(self._done) <= 0

    def close(self) -> None:
        if self._thread.is_alive():
            self._todo.put(None)
            self._thread.join(timeout=30.0)
        for store in self.stores:
            store.close()

    def __enter__(self) -> TierIO:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        while True:
            job = self._todo.get()
            if job is None:
                return
            job.started_at = time.monotonic()
            if self.delay_s:
                time.sleep(self.delay_s)
            try:
                _do(self.stores[job.tier], job)
            except Exception:  # a store broke its contract: a failure, never a dead thread
                job.ok, job.cause, job.data = False, "io_error", None
            job.ended_at = time.monotonic()
            self._done.append(job)


def _do(store: LowerTierStore, job: TierJob) -> None:
    if job.kind == "write":
        assert job.data is not None
        job.ok = store.write(job.key, job.data)
        job.data = None  # written: the bytes are the store's now
    elif job.kind == "read":
        job.data = store.read(job.key)
        job.ok = job.data is not None
    else:
        store.remove(job.key)
        job.ok = True
    if not job.ok:
        job.cause = store.last_failure
