"""What the owners of the server's state share, and how a request reaches its handler.

Runs in the cache server process. :class:`server.service.CacheService` builds one
:class:`Shared` (configuration, clock, epoch, pool, index, chunk log, eviction feed, counters,
clients, deadlines) and hands it to the owners of the rest: the sessions and their lookups
(:class:`server.sessions.Sessions`) and the transfers (:class:`server.transfers.Transfers`).
Each owner's handlers take their own request type; :class:`Routes` maps each request type to
its handler, so a request is handled by exactly the handler typed for it. A handler is a
generator that ``yield``\\s between slices of work (:meth:`Call.spend`) and returns its reply,
or raises :class:`ServiceError` for a client's mistake.

Nothing here imports an owner or the service: they import this module.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from server.cache import KVCache
from server.chunk_log import NullChunkLog
from server.config import ServerConfig
from server.eviction_feed import EvictionFeed
from server.objects import Eviction
from server.pools import MemoryPool
from server.state import ClientState, Counters, Deadlines
from server.tiers.build import NullHierarchy
from server.tiers.hierarchy import Hierarchy
from testbed.core import protocol as p
from testbed.core import telemetry
from testbed.core.chunk_events import DROP, EVICT
from testbed.core.telemetry import attributes as a

SLICE_UNITS = 512
"""Chunk operations one request may do before other clients are served (about 1-2 ms)."""
MAX_LINKS = 64

Steps = Generator[None, None, p.Reply]
"""A handler's run: yields between slices, returns the reply."""
R = TypeVar("R", bound=p.Request)


def at_once(handler: Callable[[Call, R], p.Reply]) -> Callable[[Call, R], Steps]:
    """A handler that answers without yielding, as the service drives every handler: a run of
    one slice."""

    def steps(call: Call, req: R) -> Steps:
        return handler(call, req)
        yield  # a generator, never resumed here

    return steps


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
    received_ns: int = 0
    """When the request's frame was read (``time.monotonic_ns``; 0: not known)."""

    def spend(self, units: int = 1) -> bool:
        """Counts work; True when the request has used its slice (the handler yields)."""
        self.work += units
        if self.work >= SLICE_UNITS:
            self.work = 0
            return True
        return False


@dataclass(frozen=True)
class Route:
    handler: Callable[[Call, Any], Steps]
    """Takes the request type it was added for (:meth:`Routes.add` checks the pairing)."""
    span: str | None
    """The SERVER span of the request (``None``: housekeeping, no span)."""


class Routes:
    """Request type → its handler and span name."""

    def __init__(self) -> None:
        self._routes: dict[type, Route] = {}

    def add(self, kind: type[R], handler: Callable[[Call, R], Steps], span: str | None) -> None:
        self._routes[kind] = Route(handler, span)

    def __getitem__(self, kind: type) -> Route:
        return self._routes[kind]

    def check_complete(self) -> None:
        """Raises unless every request type of the protocol has a route."""
        missing = [kind.__name__ for kind in typing.get_args(p.Request) if kind not in self._routes]
        if missing:
            raise TypeError(f"no handler for {', '.join(missing)}")


@dataclass
class Shared:
    """The state every owner reads and the few helpers they all use."""

    config: ServerConfig
    clock: Callable[[], float]
    epoch: int
    pool: MemoryPool | None
    cache: KVCache
    chunk_log: NullChunkLog
    evictions: EvictionFeed = field(default_factory=EvictionFeed)
    """Removals of committed objects, for lookups that ask (vLLM's KV events)."""
    counters: Counters = field(default_factory=Counters)
    clients: dict[bytes, ClientState] = field(default_factory=dict)
    deadlines: Deadlines = field(default_factory=Deadlines)
    tiers: Hierarchy = field(default_factory=NullHierarchy)
    """The tiers below L1 (``server.tiers``; the null hierarchy when none)."""

    def limit(self, name: str, value: int, what: str) -> ServiceError:
        """The refusal of a request over the server-wide limit ``name`` (counted)."""
        self.counters.refused_limits += 1
        flag = "--" + name.replace("_", "-")
        return ServiceError("limit", f"refused: over the server's limit of {value} {what} ({flag})")

    def check_chunks(self, num_chunks: int) -> None:
        if num_chunks > self.config.max_chunks_per_request:
            self.counters.refused_limits += 1
            raise ServiceError(
                "limit",
                f"refused: {num_chunks} chunks in one request exceed the server's limit of "
                f"{self.config.max_chunks_per_request} (--max-chunks-per-request); split the "
                "request",
            )

    def record_eviction(self, eviction: Eviction, parent: str = "") -> None:
        """The evict span (linked to the stores that wrote the objects) and its chunk log."""
        if not eviction.objects:
            return
        self.tiers.evicted(eviction, parent)  # write_back: the bytes are still in the pool
        self.evictions.record(eviction.keys)
        if eviction.reason == "capacity":
            self.counters.evicted_objects += len(eviction.objects)
            self.counters.evicted_bytes += eviction.nbytes
        storers = sorted({obj.storer for obj in eviction.objects if obj.storer})
        span = telemetry.start_span(
            a.SERVER_EVICT,
            parent=parent,
            links=eviction.origins[:MAX_LINKS],
            attributes={
                a.EVICTED_OBJECTS: len(eviction.objects),
                a.EVICTED_BYTES: eviction.nbytes,
                a.EVICT_REASON: eviction.reason,
                a.POLICY: self.config.policy,
                a.USED_BYTES: self.cache.used_bytes,
                a.CAPACITY_BYTES: self.cache.capacity_bytes,
                a.SESSION_IDS: storers[:MAX_LINKS],
            },
        )
        if self.chunk_log.enabled:
            span_id = telemetry.span_id_of(span)
            event = EVICT if eviction.reason == "capacity" else DROP
            for obj in eviction.objects:
                self.chunk_log.add_object(
                    event,
                    obj.key,
                    session_id=obj.storer,
                    cause=eviction.reason,
                    span_id=span_id,
                    nbytes=obj.nbytes,
                )
        span.end()
