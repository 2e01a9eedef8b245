"""What the request handlers (:mod:`server.lookups`, :mod:`server.transfers`,
:mod:`server.quotas`, :mod:`server.held`) see of the service: :class:`Service`, the state and
helpers :class:`server.service.CacheService` offers them; :class:`Call`, the request being
handled; :class:`ServiceError`, the typed refusal a handler raises. The handlers import this
module, never the service, so there is no import cycle: the service imports its handlers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from server.cache import Eviction, KVCache
from server.chunk_log import NullChunkLog
from server.config import ServerConfig
from server.eviction_feed import EvictionFeed
from server.pools import MemoryPool
from server.state import ChunkRun, ClientState, Counters, Deadlines, PendingLookup, Session
from testbed.core import protocol as p
from testbed.core import telemetry

SLICE_UNITS = 512


class ServiceError(Exception):
    def __init__(self, code: p.ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Call:
    """One request being handled: who sent it, its span, and its work so far."""

    client: ClientState
    request: p.Request
    span: telemetry.Span
    span_id: str
    traceparent: str
    work: int = 0

    def spend(self, units: int = 1) -> bool:
        """Counts work; True when the request has used its slice (the handler yields)."""
        self.work += units
        if self.work >= SLICE_UNITS:
            self.work = 0
            return True
        return False


class Service(Protocol):
    """The state and helpers of :class:`server.service.CacheService` its handlers use."""

    @property
    def config(self) -> ServerConfig: ...
    @property
    def clock(self) -> Callable[[], float]: ...
    @property
    def epoch(self) -> int: ...
    @property
    def pool(self) -> MemoryPool | None: ...
    @property
    def cache(self) -> KVCache: ...
    @property
    def chunk_log(self) -> NullChunkLog: ...
    @property
    def evictions(self) -> EvictionFeed: ...
    @property
    def counters(self) -> Counters: ...
    @property
    def clients(self) -> dict[bytes, ClientState]: ...
    @property
    def sessions(self) -> dict[str, Session]: ...
    @property
    def deadlines(self) -> Deadlines: ...

    def session(self, call: Call, session_id: str, *, create: bool) -> Session | None: ...
    def drop_session(self, session_id: str) -> None: ...
    def track(self, session: Session, run: ChunkRun, *, lookup: bool) -> None: ...
    def limit(self, name: str, value: int, what: str) -> ServiceError: ...
    def pending_expiry(self, pending: PendingLookup) -> float: ...
    def check_chunks(self, num_chunks: int) -> None: ...
    def record_eviction(self, eviction: Eviction, parent: str = "") -> None: ...
