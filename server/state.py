"""What the server holds besides the index: clients, sessions, operations in flight, counters.

Everything here has an owner (the client connection that made it) and a deadline, so the
housekeeping of ``server.service`` can expire what its owner never finished, and a client's
death can release all it held. Plain data, no sockets.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Protocol

from server.objects import CacheObject, ObjectKey, Space
from testbed.core import protocol as p
from testbed.core.keys import ChunkHash

SESSION_INDEX_BYTES = 400
TRACKED_CHUNK_INDEX_BYTES = 60
CLIENT_INDEX_BYTES = 1024


class DeviceEvent(Protocol):
    """Where asynchronous (CUDA) copies complete: ``synchronize`` returns once they have."""

    def synchronize(self) -> None: ...


@dataclass
class Worker:
    request: p.RegisterWorker
    object_bytes: int
    engine: Any = None
    """Server-driven transfers: the worker's KV mapped here (``server.kv_copier.EngineKV``, or
    ``server.cuda_engine.CudaEngineKV`` for CUDA KV)."""
    pool_buffer: Any = None
    """The pool as that engine copies to and from it (a numpy array, or a torch tensor)."""

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def key(self, chunk_hash: ChunkHash, cache_salt: str) -> ObjectKey:
        r = self.request
        return ObjectKey(r.model, r.world_size, r.kv_rank, chunk_hash, cache_salt)


@dataclass
class InflightStore:
    op_id: int
    objects: list[CacheObject]
    positions: list[tuple[str, int]]
    """Per object: the session and chunk index it stores (for the chunk log)."""
    deadline: float
    span_id: str = ""
    session_ids: frozenset[str] = frozenset()
    """The sessions of the operation's items (whose engine it is working for)."""
    done: DeviceEvent | None = None
    """CUDA copies into the slots: settled before a slot is committed or freed."""


@dataclass
class InflightRetrieve:
    op_id: int
    items: list[tuple[str, bytes, list[ObjectKey], list[bool]]]
    """Per item: session id, lock-group handle, the chunk keys, which were present (pinned)."""
    object_bytes: int
    deadline: float
    done: DeviceEvent | None = None
    """CUDA copies out of the pinned slots: settled before they are unpinned."""


@dataclass
class PendingLookup:
    request: p.Lookup
    deadline: float
    polls: int = 0
    from_tier: dict[ChunkHash, str] = field(default_factory=dict)
    """Chunks matched below L1 (and sent for), with the hit source that held them then."""
    unsent: ChunkHash | None = None
    """A chunk a lower tier held but the prefetch could not send for (its bound, or no room
    in L1): the hit ends there with miss status ``prefetch_timeout``."""


@dataclass
class ClientState:
    """One client connection (routing ids are chosen by the server and never reused)."""

    client_id: bytes
    last_seen: float
    worker: Worker | None = None
    stores: dict[int, InflightStore] = field(default_factory=dict)
    retrieves: dict[int, InflightRetrieve] = field(default_factory=dict)
    sessions: set[str] = field(default_factory=set)
    tracked_chunks: int = 0
    """Chunks in the refresh lists of its sessions (its share of the service's count)."""
    waits_for_lookups: bool = True
    """Its stores sent ``after_lookup`` wait for their lookups; off once one waited in vain
    (a client that names sessions nobody looks up never holds the server's loop again)."""

    def op_ids(self) -> set[int]:
        return set(self.stores) | set(self.retrieves)


class ChunkRun(NamedTuple):
    """Objects of one namespace: every hash on every rank in ``ranks``."""

    space: Space
    hashes: list[ChunkHash]
    ranks: tuple[int, ...]

    @property
    def num_objects(self) -> int:
        return len(self.hashes) * len(self.ranks)

    def object_keys(self) -> list[ObjectKey]:
        return [self.space.key(h, rank) for h in self.hashes for rank in self.ranks]


@dataclass
class Session:
    session_id: str
    owner: bytes
    last_seen: float
    looked_up: ChunkRun | None = None
    """What the session's latest lookup hit (refreshed when the session ends)."""
    stored: list[ChunkRun] = field(default_factory=list)
    """What the session's stores committed (refreshed when the session ends)."""
    handle: bytes = b""
    """The lock group of the session's latest lookup."""
    pending: PendingLookup | None = None

    @property
    def refresh(self) -> list[ChunkRun]:
        """Objects to refresh when the session ends."""
        return ([self.looked_up] if self.looked_up is not None else []) + self.stored

    @property
    def tracked_chunks(self) -> int:
        return sum(run.num_objects for run in self.refresh)


@dataclass
class Counters:
    evicted_objects: int = 0
    evicted_bytes: int = 0
    expired_locks: int = 0
    expired_ops: int = 0
    aborted_ops: int = 0
    stored_bytes: int = 0
    retrieved_bytes: int = 0
    errors: int = 0
    unauthorized: int = 0
    forbidden: int = 0
    refused_limits: int = 0
    dropped_frames: int = 0
    refused_quotas: int = 0
    quota_settled: int = 0
    """Lookups answered at once instead of left pending (over a client's pending quota)."""
    unauthenticated_closed: int = 0
    """Connections closed for not authenticating (``server.connections``; the loop copies
    its count here)."""
    prefetch_timeouts: int = 0
    """Lookups whose hit ended at a chunk still on its way up from a lower tier."""
    tier_read_failures: int = 0
    """Lookups whose hit ended at a chunk whose read from a lower tier failed."""
    lookups: int = 0
    lookup_hit_chunks: int = 0
    lookup_miss_chunks: int = 0
    mirror_answers: int = 0
    mirror_wrong: int = 0
    mirror_wrong_chunks: int = 0
    mirror_overestimates: int = 0
    errors_by_code: dict[str, int] = field(default_factory=dict)


DeadlineKind = Literal["store", "retrieve", "pending", "session"]
"""What a deadline ends: an in-flight store or retrieve, a pending lookup, an idle session."""
Deadline = tuple[float, DeadlineKind, bytes, object]
"""``(deadline, kind, owner, id)``."""


class Deadlines:
    """A lazy min-heap of ``(deadline, kind, owner, id)``; the caller re-checks each entry it
    pops (the thing may be gone or its deadline moved), and re-adds what is still live."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, DeadlineKind, bytes, object]] = []
        self._seq = itertools.count()

    def add(self, deadline: float, kind: DeadlineKind, owner: bytes, ident: object) -> None:
        heapq.heappush(self._heap, (deadline, next(self._seq), kind, owner, ident))

    def due(self, now: float) -> Iterator[tuple[DeadlineKind, bytes, object]]:
        while self._heap and self._heap[0][0] <= now:
            _, _, kind, owner, ident = heapq.heappop(self._heap)
            yield kind, owner, ident

    def __len__(self) -> int:
        return len(self._heap)

    def compact(self, live: list[Deadline]) -> None:
        """Replaces the heap by ``live`` entries (when stale ones pile up)."""
        self._heap = [(d, next(self._seq), k, o, i) for d, k, o, i in live]
        heapq.heapify(self._heap)
