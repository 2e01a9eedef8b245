"""Wire protocol between the connector (scheduler and worker sides) and the cache server.

Every message is a typed ``msgspec`` struct encoded as MessagePack, one ZeroMQ frame per
message (DEALER clients, ROUTER server). Requests and replies are tagged unions on the
``op`` field, which comes first in every frame; unknown fields are refused, so nothing is
decoded deeper than the schema. Nothing is pickled. Each request carries

- ``v``: the protocol version; the server refuses other versions with an :class:`Error`;
- ``rid``: a client-chosen correlation id echoed in the reply;
- ``auth``: the credential (every request but :class:`Ping`): the server's client token, or
  its admin token for administration (:class:`DropObjects`);
- ``traceparent`` / ``tracestate``: W3C trace context, so a server span can be the child of
  the connector span that caused it (empty when tracing is off).

A :class:`Batch` carries several requests in one frame (a client's fire-and-forget releases
and ends of sessions ride with its next lookup); the server handles them one by one, exactly
as if they had come alone, and sends the replies ready together as one :class:`Replies`.

Every reply carries the server's ``epoch``: a random id chosen at each server start. A
worker that sees a new epoch has talked to another server instance (a restart): it
registers again and maps the new pool; worker operations name the epoch they were planned
for, and the server refuses operations of another epoch (``stale_epoch``).

Bulk KV bytes never travel here: stores and retrieves exchange *slots* in the server's
shared-memory pool (see ``server.pool``) and the worker copies the bytes itself, or the server
copies them from the engine's KV that it maps (server-driven: a shared-memory file on CPU, CUDA
IPC handles on GPU; the CUDA descriptors are their own section below).

Ownership: the server identifies a client by its connection (ZeroMQ routing ids are chosen
by the server and never reused). Sessions, lock groups, store reservations and retrieve pins
belong to the client that made them; a client's disconnect or silence releases all of it.
Operations are named by client-chosen ``op_id`` (unique among the client's operations in
flight), so a client that gave up waiting can :class:`Abort` what it never saw answered.

Lifecycle of the cache operations (DESIGN.md §2):

- ``Lookup`` (scheduler): longest prefix of chunk hashes present on every KV rank; takes
  ``num_readers`` read locks per object, as one *lock group* named by the reply's random
  ``handle`` (the capability that lets the engine's workers release them). May answer
  ``pending`` while a store of the next chunk is in flight; the caller then sends
  ``LookupPoll``. A lookup may also ask which chunks were removed from the cache since the
  last removal it saw (``evictions_after``): a scheduler that announces what the cache holds
  (vLLM's KV events) learns of evictions from the replies it reads anyway.
- ``FreeLocks`` (scheduler): releases the session's locks on complete chunks inside a
  token range (chunks vLLM's own prefix cache already holds).
- ``StoreBegin`` → worker copies into the returned slots → ``StoreCommit`` (worker).
- ``RetrieveBegin`` → worker copies out of the returned slots → ``RetrieveEnd`` (worker);
  ``RetrieveEnd`` releases one lock unit per chunk of the item's lock group whether or not
  the copy succeeded. Only a ``RetrieveDone`` reply proves the pins held during the copy.
- ``Abort`` (worker): drops reservations and pins of operations the client gave up on.
- ``EndSession`` (scheduler): refreshes the recency of the session's objects and forgets the
  session; it does not release locks (retrieve, ``FreeLocks`` or the lock TTL do).
- Every in-flight item (reservation, pin, pending lookup, lock group) has a deadline; the
  server's housekeeping expires what its owner never finished.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from testbed.core.keys import HASH_BYTES, ChunkHash
from testbed.core.kv_layout import PagedLayout, SharedKVFile

PROTOCOL_VERSION = 4

WireChunkHash = Annotated[ChunkHash, msgspec.Meta(min_length=HASH_BYTES, max_length=HASH_BYTES)]
"""A chunk's key (:data:`testbed.core.keys.ChunkHash`) on the wire: its length checked."""
Count = Annotated[int, msgspec.Meta(ge=0)]
OpId = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
Name = Annotated[str, msgspec.Meta(max_length=512)]
Credential = Annotated[str, msgspec.Meta(max_length=256)]
Handle = Annotated[bytes, msgspec.Meta(max_length=32)]
TraceHeader = Annotated[str, msgspec.Meta(max_length=512)]
# Bounded so that a hostile length prefix cannot make the decoder allocate without limit;
# the server's own limits (``--max-chunks-per-request``) are usually lower.
MAX_CHUNKS_PER_ITEM = 1 << 16
MAX_ITEMS_PER_BATCH = 1 << 12
ChunkHashes = Annotated[list[WireChunkHash], msgspec.Meta(max_length=MAX_CHUNKS_PER_ITEM)]


class _Message(
    msgspec.Struct, kw_only=True, tag_field="op", omit_defaults=True, forbid_unknown_fields=True
):
    v: int = PROTOCOL_VERSION
    rid: Count = 0


class _Request(_Message, kw_only=True):
    auth: Credential = ""
    traceparent: TraceHeader = ""
    tracestate: TraceHeader = ""


class _Reply(_Message, kw_only=True):
    epoch: Count = 0
    """The answering server instance (random per start); 0 only in replies to undecodable
    frames, which cannot be attributed to any request."""
    received_ns: Count = 0
    """When the server read the request's frame off its socket (its ``CLOCK_MONOTONIC``, ns;
    0: not stamped, as for a request refused before it was handled)."""
    replied_ns: Count = 0
    """When the server handed the reply to its socket (the same clock). With ``received_ns``
    it splits a round trip into transit and the server's time (``testbed.core.rpc``);
    comparable with the client's clock only on one host."""


# ---------------------------------------------------------------------------------------------
# CUDA IPC descriptors (server-driven transfers of CUDA KV)
# ---------------------------------------------------------------------------------------------
#
# A worker whose KV lives in CUDA memory exports each storage once, at registration
# (``connector.cuda_ipc``); the server opens them on the device with the same UUID
# (``server.cuda_engine``) and closes them when the worker goes or registers again. Copies are
# ordered by interprocess CUDA events: a store or retrieve carries the engine's *ready* event
# (recorded after the forward pass that wrote, or last read, the blocks); the server's stream
# waits on it, copies, and records a *done* event that the plan carries back. The worker's
# operation completes when that event has (``StoreCommit`` / ``RetrieveEnd`` follow then).

IpcHandle = Annotated[bytes, msgspec.Meta(min_length=64, max_length=64)]
"""A ``cudaIpcMemHandle_t`` or ``cudaIpcEventHandle_t`` (64 bytes)."""
DeviceUuid = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
"""The GPU's UUID as torch prints it: device indices differ between processes."""


class CudaStorage(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One CUDA storage of the engine's KV, as ``UntypedStorage._share_cuda_`` exports it."""

    device_uuid: DeviceUuid
    ipc_handle: IpcHandle
    """The IPC handle of the ``cudaMalloc`` block the storage lies in."""
    storage_bytes: Annotated[int, msgspec.Meta(ge=1)]
    offset_bytes: Count
    """Where the storage starts in that block."""
    ref_counter_handle: Annotated[bytes, msgspec.Meta(max_length=256)] = b""
    """torch's shared reference counter (a shared-memory name): the exporter keeps the block
    while an importer holds it."""
    ref_counter_offset: Count = 0
    event_handle: Annotated[bytes, msgspec.Meta(max_length=64)] = b""
    """An event torch recorded at export; the importer waits on it before the first use."""
    event_sync_required: bool = False


class CudaKV(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A worker's paged KV in CUDA memory: its storages and where each layer lies in one.

    ``layout.layer_offsets_bytes[l]`` counts from the start of storage ``layer_storages[l]``;
    the strides describe the physical layout, so non-contiguous views export as they are."""

    storages: Annotated[list[CudaStorage], msgspec.Meta(min_length=1, max_length=4096)]
    layer_storages: Annotated[list[Count], msgspec.Meta(max_length=4096)]
    layout: PagedLayout

    def __post_init__(self) -> None:
        if len(self.layer_storages) != self.layout.num_layers:
            raise ValueError(
                f"{len(self.layer_storages)} layer storages for {self.layout.num_layers} layers"
            )
        extent = self.layout.layer_extent_bytes()
        for index, offset in zip(self.layer_storages, self.layout.layer_offsets_bytes, strict=True):
            if index >= len(self.storages):
                raise ValueError(f"layer storage {index} of {len(self.storages)}")
            if offset + extent > self.storages[index].storage_bytes:
                raise ValueError(
                    f"a layer reaches byte {offset + extent} of a "
                    f"{self.storages[index].storage_bytes}-byte storage"
                )
        if len({s.device_uuid for s in self.storages}) != 1:
            raise ValueError("one worker's KV storages must all be on one device")


class CudaEvent(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """An interprocess CUDA event (``torch.cuda.Event(interprocess=True).ipc_handle()``)."""

    device_uuid: DeviceUuid
    ipc_handle: IpcHandle


# ---------------------------------------------------------------------------------------------
# Resources: pool media (RELIABILITY.md)
# ---------------------------------------------------------------------------------------------

PoolMedium = Literal["shm", "disk", "pinned-host", "gpu"]
"""Where a server's pool lives: ``shm`` (``/dev/shm``, the default without a CUDA device),
``disk`` (a directory, only when asked for), ``pinned-host`` (``/dev/shm`` page-locked for
CUDA copies, the default where a CUDA device is visible) or ``gpu`` (device memory).
A closed set (``server.pools``)."""
POOL_MEDIA: tuple[PoolMedium, ...] = ("shm", "disk", "pinned-host", "gpu")


# ---------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------


class Ping(_Request, tag="ping", kw_only=True):
    """Readiness and round-trip probe; the only request that needs no credential."""


class Heartbeat(_Request, tag="heartbeat", kw_only=True):
    """Liveness signal; every request also counts as one."""


class GetConfig(_Request, tag="get_config", kw_only=True):
    """Asks for chunk size, capacity, policy and limits (clients must use the chunk size)."""


class GetStats(_Request, tag="get_stats", kw_only=True):
    """Asks for the server's counters and current state (objects, bytes, locks, sessions)."""


class KVLayout(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What one worker holds for one chunk: its shard of the KV of ``chunk_size`` tokens."""

    num_layers: Annotated[int, msgspec.Meta(ge=1, le=4096)]
    block_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]
    bytes_per_token: Annotated[int, msgspec.Meta(ge=1, le=1 << 30)]
    dtype: Name = "float16"


class RegisterWorker(_Request, tag="register_worker", kw_only=True):
    """A worker announces its KV layout and identity; the reply maps it to the pool.

    With ``shared_kv`` (server-driven transfers, LMCache's ``lmcache_driven``) the worker's
    paged KV lives in that shared file, the server maps it and does every copy itself; with
    ``cuda_kv`` it lives in CUDA memory that the server opens through CUDA IPC."""

    model: Name
    world_size: Annotated[int, msgspec.Meta(ge=1, le=4096)]
    kv_rank: Count
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 1
    mla: bool = False
    layout: KVLayout
    shared_kv: SharedKVFile | None = None
    cuda_kv: CudaKV | None = None


class UnregisterWorker(_Request, tag="unregister_worker", kw_only=True):
    """A worker leaves; its in-flight stores are aborted and its pins released."""


class Lookup(_Request, tag="lookup", kw_only=True):
    """Longest stored prefix of ``chunk_hashes`` on all ``world_size`` KV ranks; locks it."""

    session_id: Name
    model: Name
    world_size: Annotated[int, msgspec.Meta(ge=1, le=4096)]
    cache_salt: Name = ""
    chunk_hashes: ChunkHashes
    num_readers: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 1
    evictions_after: Count | None = None
    """Asks for the chunks of this model and world size removed from the cache (evicted or
    dropped) after removal number ``evictions_after`` (a client starts at
    ``ServerConfigInfo.eviction_seq``); ``None``: not asked. See :class:`LookupResult`."""
    tier_events: bool = False
    """With ``evictions_after``: asks for the changes of the tiers below L1 too (chunks
    committed in and removed from each), numbered in the same stream (``tier_changes``)."""
    commits: bool = False
    """With ``evictions_after``: asks for the chunks committed in L1 too (by any client),
    numbered in the same stream (``committed``): what a scheduler's lookup mirror needs to
    know what the cache holds (``connector.mirror``)."""
    lock: bool = True
    """False: the scheduler already answered the lookup itself from its mirror (a miss) and
    does not wait for this reply. The server matches, logs and counts it as any lookup but
    takes no locks and never answers ``pending``."""
    mirror_hit_chunks: Count | None = None
    """The hit the scheduler's mirror predicted (``None``: no mirror). The server counts the
    lookups the mirror answered wrong: it held chunks beyond both the prediction and
    ``engine_hit_tokens`` (``ServerStats.mirror_wrong``)."""
    engine_hit_tokens: Count = 0
    """With ``mirror_hit_chunks``: the prompt tokens vLLM's own prefix cache held (chunks within
    them would not have been loaded whatever the answer)."""


class LookupPoll(_Request, tag="lookup_poll", kw_only=True):
    """Asks again for a lookup that was answered ``pending``."""

    session_id: Name


class FreeLocks(_Request, tag="free_locks", kw_only=True):
    """Releases the session's read locks on complete chunks inside [start_token, end_token)."""

    session_id: Name
    start_token: Count = 0
    end_token: Count


class EndSession(_Request, tag="end_session", kw_only=True):
    """The request finished: refresh its objects' recency and forget the session."""

    session_id: Name


class OpItem(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One request's part of a batched store or retrieve.

    ``first_chunk`` is the index of ``chunk_hashes[0]`` in the request's chunk sequence (so
    spans and the chunk log can say which chunks of the prompt are concerned). ``handle`` is
    the lock group of the session's lookup (empty when the lookup hit nothing): a retrieve
    releases its locks only with it; a store links its objects to the session with it.
    """

    session_id: Name
    cache_salt: Name = ""
    chunk_hashes: ChunkHashes
    first_chunk: Count = 0
    handle: Handle = b""
    traceparent: TraceHeader = ""
    block_ids: Annotated[list[Count], msgspec.Meta(max_length=MAX_CHUNKS_PER_ITEM * 64)] = []
    """Server-driven transfers: the engine's KV blocks of the chunks, in order."""
    skip_blocks: Count = 0
    """Server-driven retrieves: leading blocks the engine already holds (never written)."""
    after_lookup: bool = False
    """Stores: the session's lookup was sent on the scheduler's connection without waiting for
    its answer; a store read before that lookup waits for it (50 ms at most; a client whose
    store waited in vain waits no more), so that the lookup sees the cache as it was before the
    request's own stores, whichever connection the server read first."""


class _BatchBegin(_Request, kw_only=True):
    """The start of a batched store or retrieve: its fields, the same in both."""

    op_id: OpId
    epoch: Count
    """The epoch the worker registered (and mapped the pool) with."""
    items: Annotated[list[OpItem], msgspec.Meta(max_length=MAX_ITEMS_PER_BATCH)]
    ready_event: CudaEvent | None = None
    """CUDA IPC: the server copies only after this event (a store's: the forward pass wrote
    the blocks; a retrieve's: earlier reads of the blocks are done)."""


class StoreBegin(_BatchBegin, tag="store_begin", kw_only=True):
    """Reserve pool slots for the chunks of each item not stored yet."""


class StoreCommit(_Request, tag="store_commit", kw_only=True):
    """The worker finished copying into the slots of ``op_id`` (``ok``) or gave up."""

    op_id: OpId
    ok: bool = True


class RetrieveBegin(_BatchBegin, tag="retrieve_begin", kw_only=True):
    """Pin the chunks of each item and return their slots (``None`` where missing)."""


class RetrieveEnd(_Request, tag="retrieve_end", kw_only=True):
    """The worker finished copying out of ``op_id``; releases pins and read locks."""

    op_id: OpId
    ok: Annotated[list[bool], msgspec.Meta(max_length=MAX_ITEMS_PER_BATCH)] = []


class Abort(_Request, tag="abort", kw_only=True):
    """Drops this client's operations ``op_ids`` (stores aborted, pins and their lock units
    released), answered or not; unknown ids are ignored, so aborting is idempotent."""

    op_ids: Annotated[list[OpId], msgspec.Meta(max_length=MAX_ITEMS_PER_BATCH)]


class DropObjects(_Request, tag="drop_objects", kw_only=True):
    """Administration and fault injection (admin credential): removes stored chunks with these
    hashes (any model, rank or salt; all chunks when empty). Locked chunks only with ``force``
    (their locks are released); chunks being copied (pinned or uncommitted) are never
    dropped."""

    chunk_hashes: ChunkHashes = []
    force: bool = False


# ---------------------------------------------------------------------------------------------
# What one engine left on a shared server
# ---------------------------------------------------------------------------------------------


class GetHeld(_Request, tag="get_held", kw_only=True):
    """Asks what the sessions of one engine still hold: ``owner`` is the engine id that
    prefixes its session ids (``<owner>:<request id>``, the connector's ``engine_id``; a
    run's id for ``kvtb run``). Runs sharing a server check their own quiescence with it."""

    owner: Name


# ---------------------------------------------------------------------------------------------
# Peers: the cache servers of one fleet, one per instance, asking each other (server.peering)
# ---------------------------------------------------------------------------------------------


class PeerEndpoint(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    url: Name
    token: Credential
    name: Name = ""
    """How spans and ``kvtb explain`` name the peer (a fleet's ``instance 2``); empty: its URL."""


class SetPeers(_Request, tag="set_peers", kw_only=True):
    """Administration (admin credential): the other servers this one asks when a lookup misses
    locally (replaces the previous list; empty: none)."""

    peers: Annotated[list[PeerEndpoint], msgspec.Meta(max_length=256)] = []


class PeerProbe(_Request, tag="peer_probe", kw_only=True):
    """From a peer server: how many leading chunks of ``chunk_hashes`` are held here (committed
    on every one of ``world_size`` ranks). Takes no lock and changes nothing."""

    model: Name
    world_size: Annotated[int, msgspec.Meta(ge=1, le=4096)]
    cache_salt: Name = ""
    chunk_hashes: ChunkHashes


class PeerFetch(PeerProbe, tag="peer_fetch", kw_only=True):
    """From a peer server: the bytes of the leading chunks of ``chunk_hashes`` held here (fewer
    than asked if some were evicted since the probe, or past ``max_bytes``); a fetch counts as
    a hit of those chunks here."""

    max_bytes: Annotated[int, msgspec.Meta(ge=0)] = 64 << 20


Request = (
    Ping
    | Heartbeat
    | GetConfig
    | GetStats
    | RegisterWorker
    | UnregisterWorker
    | Lookup
    | LookupPoll
    | FreeLocks
    | EndSession
    | StoreBegin
    | StoreCommit
    | RetrieveBegin
    | RetrieveEnd
    | Abort
    | DropObjects
    | GetHeld
    | SetPeers
    | PeerProbe
    | PeerFetch
)


class Batch(_Request, tag="batch", kw_only=True):
    """Several requests in one frame, handled in order as if each had come alone: each carries
    its own ``rid``, credential and trace context, gets its own span and its own reply (the
    replies that are ready together come back as one :class:`Replies`). The batch's own
    credential authenticates the connection; a batch is never nested."""

    requests: Annotated[list[Request], msgspec.Meta(min_length=1, max_length=MAX_ITEMS_PER_BATCH)]


ADMIN_REQUESTS = (DropObjects, SetPeers)
"""Requests that need the admin credential."""

# ---------------------------------------------------------------------------------------------
# Replies
# ---------------------------------------------------------------------------------------------


class Pong(_Reply, tag="pong", kw_only=True):
    server_version: str
    pid: int


class Ack(_Reply, tag="ack", kw_only=True):
    pass


class ServerConfigInfo(_Reply, tag="config", kw_only=True):
    chunk_size: int
    capacity_bytes: int
    policy: str
    metadata_only: bool
    read_lock_ttl_s: float
    session_ttl_s: float
    op_ttl_s: float = 0.0
    max_chunks_per_request: int = 0
    min_object_bytes: int = 0
    eviction_seq: Count = 0
    """The number of the latest removal from the cache (``Lookup.evictions_after``)."""
    pool_medium: PoolMedium | None = None
    """Where the pool lives (``None``: no pool, metadata only)."""
    lookups_fill_l1: bool = False
    """The server has tiers below L1: a lookup brings its hits from below into L1 before it is
    answered (a prefetch), so it needs room in L1 that chunks other lookups still lock cannot
    give (the connector holds back a lookup asked in the step that admitted a load)."""


class TierStats(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One tier below L1 (``name`` L2, L3, ...; ``kind`` its hit-source name), since start."""

    name: str
    kind: str
    capacity_bytes: int
    used_bytes: int = 0
    num_objects: int = 0
    reads: int = 0
    """Objects read from the tier (each verified before it reached L1)."""
    read_bytes: int = 0
    writes: int = 0
    """Objects written to the tier (write-through, selective and write-back alike)."""
    written_bytes: int = 0
    promotions: int = 0
    """Objects read from the tier and committed in L1 (a prefetch that arrived)."""
    demotions: int = 0
    """Objects L1 evicted that went down to the tier (``write_back``)."""
    write_backs: int = 0
    """Demotions whose write succeeded."""
    evictions: int = 0
    """Objects the tier evicted to make room (its own policy)."""
    failures: int = 0
    """Reads and writes that failed (``failures_by_cause``): never a wrong byte served."""
    failures_by_cause: dict[str, int] = {}
    dropped_writes: int = 0
    """Writes not even tried: the tier's write queue was full (back-pressure)."""
    adopted: int = 0
    """Objects another server wrote to a shared tier (redis), entered into this server's index
    when a lookup found them there."""


class PeerStats(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Peer-to-peer since start (``server.peering``): what this server's lookups brought from
    its peers, and what it served them."""

    lookups: int = 0
    """Lookups that missed here and asked the peers."""
    peer_hits: int = 0
    """Of those, lookups that brought at least one chunk from a peer."""
    chunks: int = 0
    """Chunks copied from peers into L1."""
    bytes: int = 0
    probe_failures: int = 0
    """Probes not answered (a peer down, or past the timeout)."""
    fetch_failures: int = 0
    short_chunks: int = 0
    """Chunks a peer said it held but did not send (evicted between probe and fetch, past a
    fetch's byte bound), or that could not be placed here."""
    corrupt_objects: int = 0
    """Objects whose bytes did not match their digest (never committed)."""
    served_probes: int = 0
    served_chunks: int = 0
    served_bytes: int = 0


class TierUsage(msgspec.Struct, frozen=True, kw_only=True):
    """What one tier of the server's cache holds (``host``: the shared-memory pool's index;
    a lower tier by its hit-source name, ``disk`` or ``remote``)."""

    tier: str
    num_objects: int
    used_bytes: int
    capacity_bytes: int


class ServerStats(_Reply, tag="stats", kw_only=True):
    num_objects: int
    used_bytes: int
    capacity_bytes: int
    num_locks: int
    num_lock_groups: int
    num_pins: int
    num_sessions: int
    num_clients: int
    num_workers: int
    num_pending_lookups: int
    num_inflight_stores: int
    num_inflight_retrieves: int
    num_tracked_chunks: int
    index_bytes: int
    """Estimated memory of the index outside the pool (objects, sessions, locks)."""
    evicted_objects: int
    evicted_bytes: int
    expired_locks: int
    expired_ops: int
    aborted_ops: int
    stored_bytes: int
    retrieved_bytes: int
    errors: int
    unauthorized: int
    forbidden: int
    refused_limits: int
    dropped_frames: int
    refused_quotas: int = 0
    """Requests refused for a client's quota (``quota`` errors; ``refused_limits``: the
    server-wide limits)."""
    chunk_events_dropped: int = 0
    """Chunk log rows lost: not written (a full or failing disk) and no longer kept."""
    chunk_events_pending: int = 0
    """Chunk log rows not written yet, kept in memory until the disk takes them."""
    unauthenticated_closed: int = 0
    """Connections closed for sending no authenticated request in time, or beyond the number
    of such connections allowed at once."""
    tiers: list[TierStats] = []
    """The tiers below L1, in order (empty: L1 only)."""
    prefetch_timeouts: int = 0
    """Chunks whose prefetch had not reached L1 when their lookup was answered."""
    tier_read_failures: int = 0
    """Chunks a lookup matched below L1 whose read failed (the hit ended there)."""
    lookups: int = 0
    """Lookups answered (a lookup left pending counts once, when it is answered)."""
    lookup_hit_chunks: int = 0
    """Chunks the answered lookups found: the committed prefix each locked."""
    lookup_miss_chunks: int = 0
    """Chunks the answered lookups asked for beyond their hit prefix."""
    mirror_answers: int = 0
    """Lookups a scheduler's mirror answered itself (``Lookup.lock`` False: a predicted miss,
    not waited for)."""
    mirror_wrong: int = 0
    """Of ``mirror_answers``, those where this server held more than the mirror predicted
    (the engine recomputed chunks the cache held)."""
    mirror_wrong_chunks: int = 0
    """The chunks those wrong answers missed (the server's hit minus the mirror's)."""
    mirror_overestimates: int = 0
    """Lookups a mirror sent to the server predicting more than the server then held (a
    round trip the mirror could have saved; never a wrong answer)."""
    errors_by_code: dict[str, int] = msgspec.field(default_factory=dict)
    """``errors`` by :data:`ErrorCode`."""
    tier_usage: list[TierUsage] = msgspec.field(default_factory=list)
    """Every tier's objects and bytes, in order: L1 (``host``), then ``tiers``' own."""
    peers: PeerStats | None = None
    """Peer-to-peer (``None``: this server was never given peers)."""


class WorkerRegistered(_Reply, tag="registered", kw_only=True):
    chunk_size: int
    object_bytes: int
    # Path of the shared-memory pool file to map; empty in metadata-only mode.
    pool_path: str
    pool_bytes: int


# --- removals from the cache, for clients that announce what it holds (vLLM's KV events) ---

MAX_EVICTIONS_PER_REPLY = 4096


class EvictedChunk(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """A chunk no longer complete in the cache: an object of it was evicted or dropped, as the
    server's removal number ``seq`` (compare ``StoreDone.eviction_seq``)."""

    cache_salt: str
    chunk_hash: ChunkHash
    seq: Count


class TierChange(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """A chunk committed in (``stored``) or removed from a tier below L1, named by its
    hit-source name ``medium`` (``disk``, ``remote``), as the server's entry number ``seq``
    (the numbers of :class:`EvictedChunk`)."""

    cache_salt: str
    chunk_hash: ChunkHash
    seq: Count
    medium: str
    stored: bool


# ---------------------------------------------------------------------------------------------


MissStatus = Literal["", "absent", "in_flight", "prefetch_timeout", "tier_read_failed"]
"""Why the chunk after a lookup's hit is not one (empty: a full hit)."""


class LookupResult(_Reply, tag="lookup_result", kw_only=True):
    """``pending`` means: poll again; otherwise ``hit_chunks`` complete chunks are locked as
    the lock group ``handle``. ``miss_status`` says why the chunk after the hit is not one:
    ``absent`` or ``in_flight`` (its store had not committed), ``prefetch_timeout`` (a lower
    tier did not bring it up in time) or ``tier_read_failed``; empty on a full hit."""

    pending: bool = False
    hit_chunks: Count = 0
    num_locks: Count = 0
    handle: bytes = b""
    miss_status: MissStatus = ""
    evicted: list[EvictedChunk] = []
    """When the lookup asked (``evictions_after``): chunks removed since, oldest first, at most
    :data:`MAX_EVICTIONS_PER_REPLY` (ask again from ``eviction_seq`` for the rest)."""
    eviction_seq: Count = 0
    """The number of the last removal ``evicted`` covers."""
    evictions_lost: bool = False
    """Removals after ``evictions_after`` are no longer known (the server forgot the oldest,
    or restarted): whatever the client believed stored may be gone."""
    tier_changes: list[TierChange] = []
    """When the lookup asked (``tier_events``): the tiers' changes in the entries ``evicted``
    covers, oldest first (together with ``evicted`` at most :data:`MAX_EVICTIONS_PER_REPLY`)."""
    committed: list[EvictedChunk] = []
    """When the lookup asked (``commits``): chunks committed in L1 in the entries
    ``evicted`` covers, oldest first (``seq``: the commit's number; counted in the same
    :data:`MAX_EVICTIONS_PER_REPLY`)."""
    hit_chunks_by_tier: dict[str, int] = {}
    """Where the hit's chunks were matched, at match time: hit-source name (``host`` for L1,
    ``disk``, ``remote``, ``p2p``) -> chunks; sums to ``hit_chunks`` (empty on a miss). A
    chunk matched below L1 was brought into L1 before this reply (a prefetch)."""


class LocksFreed(_Reply, tag="locks_freed", kw_only=True):
    num_chunks: int
    num_locks: int


class Slot(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    offset: int
    nbytes: int


class ItemSlots(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Per chunk of an item: where to copy, or ``None`` (store: skip; retrieve: missing)."""

    slots: list[Slot | None]
    num_present: int = 0
    num_full: int = 0


class StorePlan(_Reply, tag="store_plan", kw_only=True):
    """The reserved slots; ``copied``: the server already copied the blocks into them
    (server-driven), so the worker only commits."""

    op_id: int
    items: list[ItemSlots]
    evicted_objects: int = 0
    copied: bool = False
    done_event: CudaEvent | None = None
    """CUDA IPC: the server's copies are ordered on its stream and complete with this event;
    the worker commits only then."""


class StoreDone(_Reply, tag="store_done", kw_only=True):
    num_committed: int
    num_aborted: int
    eviction_seq: Count = 0
    """The server's latest removal number when the objects were committed: a removal of one of
    them numbered above it came later (see ``LookupResult.evicted``)."""


class RetrievePlan(_Reply, tag="retrieve_plan", kw_only=True):
    """The pinned slots; ``copied``: the server already copied them into the engine's blocks
    while they were pinned, unpinned them and released the items' lock units (server-driven:
    no ``RetrieveEnd`` follows). With ``done_event`` (CUDA IPC) the copies are ordered on the
    server's stream instead: the pins hold until the worker, once the event completed, sends
    ``RetrieveEnd`` (or the operation's deadline)."""

    op_id: int
    items: list[ItemSlots]
    copied: bool = False
    num_locks_released: int = 0
    done_event: CudaEvent | None = None


class RetrieveDone(_Reply, tag="retrieve_done", kw_only=True):
    num_locks_released: int


class Aborted(_Reply, tag="aborted", kw_only=True):
    num_aborted: int


class Dropped(_Reply, tag="dropped", kw_only=True):
    num_objects: int
    num_bytes: int
    num_locks_released: int


class Held(_Reply, tag="held", kw_only=True):
    """What one owner's sessions hold (:class:`GetHeld`): all zeros when it left nothing."""

    num_locks: Count = 0
    num_pins: Count = 0
    num_inflight_stores: Count = 0
    num_inflight_retrieves: Count = 0
    num_pending_lookups: Count = 0
    num_sessions: Count = 0


ErrorCode = Literal[
    "malformed",
    "too_large",
    "version",
    "unauthorized",
    "forbidden",
    "limit",
    "not_registered",
    "stale_epoch",
    "unknown_id",
    "conflict",
    "invalid",
    "internal",
    "quota",
]
LIMIT_CODES: tuple[ErrorCode, ...] = ("limit", "quota")
"""Codes of a valid request that a live server turned down for one of its limits (``limit``:
a server-wide one; ``quota``: one client's share). Clients count them as limit refusals
(``limit_refusals``), not as failures of the server."""


class PeerHeld(_Reply, tag="peer_held", kw_only=True):
    held_chunks: Count = 0


class PeerChunks(_Reply, tag="peer_chunks", kw_only=True):
    """The objects of the leading chunks held, chunk then rank: each object's size, its bytes
    (empty in metadata-only mode) and the blake3 digest of its bytes (verified on arrival)."""

    num_chunks: Count = 0
    nbytes: list[Count] = []
    data: list[bytes] = []
    digests: list[bytes] = []


class Error(_Reply, tag="error", kw_only=True):
    code: ErrorCode
    message: str


Reply = (
    Pong
    | Ack
    | ServerConfigInfo
    | ServerStats
    | WorkerRegistered
    | LookupResult
    | LocksFreed
    | StorePlan
    | StoreDone
    | RetrievePlan
    | RetrieveDone
    | Aborted
    | Dropped
    | Held
    | PeerHeld
    | PeerChunks
    | Error
)


class Replies(_Reply, tag="replies", kw_only=True):
    """Replies to one client that were ready together (those of a :class:`Batch`), in order."""

    replies: Annotated[list[Reply], msgspec.Meta(max_length=MAX_ITEMS_PER_BATCH)]


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request | Batch)
_reply_decoder = msgspec.msgpack.Decoder(Reply | Replies)
# fixmap (up to 15 fields) or map16 header, then the fixstr key "op": the tag comes first.
_OP_KEY = b"\xa2op"


def encode(message: _Message) -> bytes:
    return _encoder.encode(message)


def decode_request(frame: bytes) -> Request | Batch:
    """Decodes one request frame; raises ``msgspec.DecodeError`` / ``ValidationError``.

    The frame must be a map whose first key is the ``op`` tag (as :func:`encode` writes it).
    With the tag first and unknown fields refused, decoding never descends deeper than the
    schema (at most five levels, a batch included), whatever the frame holds.
    """
    if not _tag_first(frame):
        raise msgspec.DecodeError("a request must be a map whose first key is 'op'")
    return _request_decoder.decode(frame)


def decode_reply(frame: bytes) -> Reply | Replies:
    return _reply_decoder.decode(frame)


def _tag_first(frame: bytes) -> bool:
    if not frame:
        return False
    if 0x80 <= frame[0] <= 0x8F:
        return frame[1:4] == _OP_KEY
    if frame[0] == 0xDE:  # map16
        return frame[3:6] == _OP_KEY
    return False


def op_name(message: _Message) -> str:
    """The ``op`` tag of a message (``lookup``, ``store_begin``, ...)."""
    return str(message.__struct_config__.tag)
