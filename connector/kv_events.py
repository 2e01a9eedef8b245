"""What the engine announces the cache server holds: vLLM KV events for stored and evicted chunks.

Pure logic, no vLLM (the shim, :mod:`connector.vllm_telemetry`, turns payloads into vLLM's
``BlockStored`` / ``BlockRemoved`` and hands them to vLLM's KV event publisher through
``take_events``). A KV-aware router (llm-d's precise prefix-cache scorer, Dynamo's KV router)
matches the block hashes of these events against a request's own vLLM block hashes, so a
chunk is announced under vLLM's block hashes of its blocks, never under our chunk hash.

The flow, with every process doing what it can see:

- the scheduler side, planning a store, gives the announcer each chunk's payloads (the
  stored event and the removed event, built from the request) under the chunk's key
  ``(cache salt, chunk hash)`` (:meth:`ChunkAnnouncer.planned`);
- each worker reports, per chunk of each finished store, whether its store wrote and
  committed it, with the server's removal number at the commit (:func:`store_reports`); the
  reports reach the scheduler side with vLLM's worker metadata, and a chunk is announced
  stored once every writing KV rank wrote it (:meth:`ChunkAnnouncer.reported`): chunks
  another engine stored, or that found no room, are not announced by this one;
- the server's removals (evictions for room, drops), numbered, reach the scheduler side in
  the lookup replies it reads anyway (``server.eviction_feed``): an announced chunk removed
  after its commit is announced removed (:meth:`ChunkAnnouncer.evicted`); all of them when
  the server lost track (restart) (:meth:`ChunkAnnouncer.forget_all`).

The tiers below the server's L1 (a disk, a remote store) are announced under a medium of their
own (:func:`tier_medium`: ``kvtb/disk``, ``kvtb/remote``; L1 keeps ``kvtb``), from the tier
changes the same lookup replies carry (:meth:`ChunkAnnouncer.tier_changed`): a chunk this
engine planned a store of is announced stored in a tier once the tier committed it, and
removed when the tier removed it (or the server lost track), whatever L1 does meanwhile (a
``write_back`` tier receives a chunk exactly when L1 evicts it).

Removal numbers order the two streams, whichever reaches the scheduler first: a removal
numbered at or below a commit's number concerns an earlier copy of the chunk and is ignored;
one above it means the copy is gone (for a rank still to report, the chunk is not announced).
Memory is bounded: at most ``max_chunks`` chunks pending, announced and recently removed;
past that the oldest announced chunk is announced removed (a router then under-estimates what
the cache holds, never over-).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, TypeVar

from connector.ops import StoreOp
from testbed.core.keys import ChunkHash

Payload = TypeVar("Payload")
ChunkKey = tuple[str, ChunkHash]
"""``(cache salt, chunk hash)``: what names a chunk within one model and world size."""

DEFAULT_MAX_CHUNKS = 1 << 16
MEDIUM = "kvtb"
"""The ``medium`` of the events about the cache server's L1 (its shared-memory pool)."""


def tier_medium(tier: str) -> str:
    """The ``medium`` of the events about a tier (its hit-source name; ``""``: L1)."""
    return f"{MEDIUM}/{tier}" if tier else MEDIUM


def medium_tier(medium: str | None) -> str | None:
    """The tier a ``medium`` names (``""``: L1), or ``None`` for one not the server's."""
    if medium == MEDIUM:
        return ""
    prefix = f"{MEDIUM}/"
    if medium is not None and medium.startswith(prefix) and len(medium) > len(prefix):
        return medium[len(prefix) :]
    return None


class ChunkReport(NamedTuple):
    """One writing rank's outcome for one chunk of a finished store."""

    kv_rank: int
    cache_salt: str
    chunk_hash: ChunkHash
    written: bool
    """The store wrote the chunk and committed it (not: already there, no room, failed)."""
    seq: int
    """The server's removal number at the commit."""
    held: bool = False
    """Not written because the server already held it (the store's plan found no chunk of
    its op without room), as of ``seq``."""


def store_reports(
    kv_rank: int,
    ops: Sequence[StoreOp],
    slots: Sequence[Sequence[object | None]] | None,
    seq: int,
    full: Sequence[int] | None = None,
) -> list[ChunkReport]:
    """A finished store's reports: per op, per chunk, written iff the server gave the chunk a
    slot and the store committed (``slots``: the plan's slots per op; ``None`` when the store
    failed); ``held`` for a chunk without a slot in an op where no chunk lacked room
    (``full``: the plan's ``num_full`` per op)."""
    reports = []
    for index, op in enumerate(ops):
        item = slots[index] if slots is not None else [None] * len(op.chunk_hashes)
        present = slots is not None and full is not None and full[index] == 0
        for chunk_hash, slot in zip(op.chunk_hashes, item, strict=True):
            written = slot is not None
            reports.append(
                ChunkReport(
                    kv_rank, op.cache_salt, chunk_hash, written, seq, not written and present
                )
            )
    return reports


@dataclass(frozen=True)
class ChunkEvent(Generic[Payload]):
    stored: bool
    """True: the chunk is now in the cache; False: it no longer is."""
    payload: Payload
    tier: str = ""
    """The tier the event is about (its hit-source name; ``""``: L1); see :func:`tier_medium`."""


@dataclass
class _Pending(Generic[Payload]):
    stored: Payload
    removed: Payload
    seqs: dict[int, int] = field(default_factory=dict)
    """Per KV rank that wrote the chunk: the removal number at its commit."""


class ChunkAnnouncer(Generic[Payload]):
    """Chunks planned, announced and removed; events in the order they happened."""

    def __init__(self, num_writers: int, max_chunks: int = DEFAULT_MAX_CHUNKS) -> None:
        if num_writers < 1 or max_chunks < 1:
            raise ValueError("num_writers and max_chunks must be positive")
        self.num_writers = num_writers
        """KV ranks that write each chunk (every TP rank; one with MLA)."""
        self.max_chunks = max_chunks
        self._pending: OrderedDict[ChunkKey, _Pending[Payload]] = OrderedDict()
        self._announced: OrderedDict[ChunkKey, tuple[Payload, int]] = OrderedDict()
        self._removed_at: OrderedDict[ChunkKey, int] = OrderedDict()
        self._known: OrderedDict[ChunkKey, tuple[Payload, Payload]] = OrderedDict()
        """The payloads of chunks this engine planned stores of (for the tiers' events)."""
        self._in_tier: OrderedDict[tuple[ChunkKey, str], Payload] = OrderedDict()
        """Chunks announced stored in a tier below L1, with their removed payload."""
        self._events: list[ChunkEvent[Payload]] = []

    def __len__(self) -> int:
        """Chunks announced as stored and not removed since."""
        return len(self._announced)

    def planned(self, key: ChunkKey, stored: Payload, removed: Payload) -> None:
        """A store of the chunk was planned; ``stored`` / ``removed`` are its events' payloads."""
        self._known[key] = (stored, removed)
        self._known.move_to_end(key)
        _bound(self._known, self.max_chunks)
        if key in self._announced or key in self._pending:
            return
        self._pending[key] = _Pending(stored, removed)
        _bound(self._pending, self.max_chunks)

    def reported(self, reports: Iterable[ChunkReport]) -> None:
        """Workers' outcomes: a chunk every writing rank wrote is announced stored; one a rank
        did not write, or whose copy was removed since, is not announced (by this engine)."""
        for report in reports:
            key = (report.cache_salt, report.chunk_hash)
            pending = self._pending.get(key)
            if pending is None:
                continue
            if not report.written or self._removed_at.get(key, 0) > report.seq:
                del self._pending[key]
                continue
            pending.seqs[report.kv_rank] = report.seq
            if len(pending.seqs) >= self.num_writers:
                del self._pending[key]
                self._announce(key, pending)

    def evicted(self, removals: Iterable[tuple[str, ChunkHash, int]]) -> None:
        """The server removed these chunks ``(cache salt, chunk hash, removal number)``."""
        for salt, chunk_hash, seq in removals:
            key = (salt, chunk_hash)
            self._removed_at[key] = max(seq, self._removed_at.pop(key, 0))
            _bound(self._removed_at, self.max_chunks)
            announced = self._announced.get(key)
            if announced is not None and seq > announced[1]:
                del self._announced[key]
                self._events.append(ChunkEvent(False, announced[0]))
            pending = self._pending.get(key)
            if pending is not None and any(seq > commit for commit in pending.seqs.values()):
                del self._pending[key]

    def tier_changed(self, changes: Iterable[tuple[str, ChunkHash, str, bool]]) -> None:
        """The tiers below L1 committed (``stored``) or removed these chunks ``(cache salt,
        chunk hash, tier, stored)``, in order: announced for chunks this engine planned."""
        for salt, chunk_hash, tier, stored in changes:
            key = (salt, chunk_hash)
            held = self._in_tier.pop((key, tier), None)
            if held is not None and not stored:
                self._events.append(ChunkEvent(False, held, tier))
            elif held is not None:
                self._in_tier[(key, tier)] = held  # stored again: already announced
            elif stored and key in self._known:
                payloads = self._known[key]
                self._in_tier[(key, tier)] = payloads[1]
                self._events.append(ChunkEvent(True, payloads[0], tier))
                if len(self._in_tier) > self.max_chunks:
                    (_, oldest_tier), oldest = self._in_tier.popitem(last=False)
                    self._events.append(ChunkEvent(False, oldest, oldest_tier))

    def forget_all(self) -> None:
        """The server lost track of its removals (it restarted): every announced chunk may be
        gone, so all are announced removed (in every tier); numbers start again."""
        for removed, _ in self._announced.values():
            self._events.append(ChunkEvent(False, removed))
        for (_, tier), removed in self._in_tier.items():
            self._events.append(ChunkEvent(False, removed, tier))
        self._in_tier.clear()
        self._announced.clear()
        self._pending.clear()
        self._removed_at.clear()

    def take(self) -> list[ChunkEvent[Payload]]:
        """The events since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def _announce(self, key: ChunkKey, pending: _Pending[Payload]) -> None:
        self._announced[key] = (pending.removed, min(pending.seqs.values()))
        self._events.append(ChunkEvent(True, pending.stored))
        if len(self._announced) > self.max_chunks:
            _, (oldest, _) = self._announced.popitem(last=False)
            self._events.append(ChunkEvent(False, oldest))


def _bound(table: OrderedDict, limit: int) -> None:
    while len(table) > limit:
        table.popitem(last=False)
