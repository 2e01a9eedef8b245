"""Wire protocol between the connector (scheduler and worker sides) and the cache server.

Every message is a typed ``msgspec`` struct encoded as MessagePack, one ZeroMQ frame per
message (DEALER clients, ROUTER server). Requests and replies are tagged unions on the
``op`` field; nothing is pickled. Each request carries

- ``v``: the protocol version; the server refuses other versions with an :class:`Error`;
- ``rid``: a client-chosen correlation id echoed in the reply;
- ``traceparent`` / ``tracestate``: W3C trace context, so a server span can be the child of
  the connector span that caused it (empty when tracing is off).

Bulk KV bytes never travel here: stores and retrieves exchange *slots* in the server's
shared-memory pool (see ``server.pool``) and the worker copies the bytes itself.

Lifecycle of the cache operations (DESIGN.md §2):

- ``Lookup`` (scheduler): longest prefix of chunk hashes present on every KV rank; takes
  ``num_readers`` read locks per object for the session. May answer ``pending`` while a
  store of the next chunk is in flight; the caller then sends ``LookupPoll``.
- ``FreeLocks`` (scheduler): releases the session's locks on complete chunks inside a
  token range (chunks vLLM's own prefix cache already holds).
- ``StoreBegin`` → worker copies into the returned slots → ``StoreCommit`` (worker).
- ``RetrieveBegin`` → worker copies out of the returned slots → ``RetrieveEnd`` (worker);
  ``RetrieveEnd`` releases the item's read locks whether or not the copy succeeded.
- ``EndSession`` (scheduler): refreshes the recency of the session's objects and forgets the
  session; it does not release locks (retrieve, ``FreeLocks`` or the lock TTL do).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

PROTOCOL_VERSION = 1

# A chunk hash is the 16-byte rolling prefix hash of testbed.keys.
ChunkHash = Annotated[bytes, msgspec.Meta(min_length=16, max_length=16)]
Count = Annotated[int, msgspec.Meta(ge=0)]
Name = Annotated[str, msgspec.Meta(max_length=512)]
# Bounded so that a hostile length prefix cannot make the decoder allocate without limit.
MAX_CHUNKS_PER_ITEM = 1 << 16
MAX_ITEMS_PER_BATCH = 1 << 12
ChunkHashes = Annotated[list[ChunkHash], msgspec.Meta(max_length=MAX_CHUNKS_PER_ITEM)]


class _Message(msgspec.Struct, kw_only=True, tag_field="op", omit_defaults=True):
    v: int = PROTOCOL_VERSION
    rid: Count = 0


class _Request(_Message, kw_only=True):
    traceparent: str = ""
    tracestate: str = ""


# ---------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------


class Ping(_Request, tag="ping", kw_only=True):
    """Readiness and round-trip probe; any client may send it."""


class Heartbeat(_Request, tag="heartbeat", kw_only=True):
    """Liveness signal; every request also counts as one."""


class GetConfig(_Request, tag="get_config", kw_only=True):
    """Asks for chunk size, capacity and policy (clients must use the server's chunk size)."""


class GetStats(_Request, tag="get_stats", kw_only=True):
    """Asks for the server's counters and current state (objects, bytes, locks, sessions)."""


class KVLayout(msgspec.Struct, kw_only=True):
    """What one worker holds for one chunk: its shard of the KV of ``chunk_size`` tokens."""

    num_layers: Annotated[int, msgspec.Meta(ge=1, le=4096)]
    block_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]
    bytes_per_token: Annotated[int, msgspec.Meta(ge=1, le=1 << 30)]
    dtype: Name = "float16"


class RegisterWorker(_Request, tag="register_worker", kw_only=True):
    """A worker announces its KV layout and identity; the reply maps it to the pool."""

    model: Name
    world_size: Annotated[int, msgspec.Meta(ge=1, le=4096)]
    kv_rank: Count
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 1
    mla: bool = False
    layout: KVLayout


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


class OpItem(msgspec.Struct, kw_only=True):
    """One request's part of a batched store or retrieve.

    ``first_chunk`` is the index of ``chunk_hashes[0]`` in the request's chunk sequence (so
    spans and errors can say which chunks of the prompt are concerned).
    """

    session_id: Name
    cache_salt: Name = ""
    chunk_hashes: ChunkHashes
    first_chunk: Count = 0
    traceparent: str = ""


class StoreBegin(_Request, tag="store_begin", kw_only=True):
    """Reserve pool slots for the chunks of each item not stored yet."""

    items: Annotated[list[OpItem], msgspec.Meta(max_length=MAX_ITEMS_PER_BATCH)]


class StoreCommit(_Request, tag="store_commit", kw_only=True):
    """The worker finished copying into the slots of ``store_id`` (``ok``) or gave up."""

    store_id: Count
    ok: bool = True


class RetrieveBegin(_Request, tag="retrieve_begin", kw_only=True):
    """Pin the chunks of each item and return their slots (``None`` where missing)."""

    items: Annotated[list[OpItem], msgspec.Meta(max_length=MAX_ITEMS_PER_BATCH)]


class RetrieveEnd(_Request, tag="retrieve_end", kw_only=True):
    """The worker finished copying out of ``retrieve_id``; releases pins and read locks."""

    retrieve_id: Count
    ok: list[bool] = []


class DropObjects(_Request, tag="drop_objects", kw_only=True):
    """Administration and fault injection: removes stored chunks with these hashes (any model,
    rank or salt; all chunks when empty). Locked chunks only with ``force`` (their locks are
    released); chunks being copied (pinned or uncommitted) are never dropped."""

    chunk_hashes: ChunkHashes = []
    force: bool = False


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
    | DropObjects
)

# ---------------------------------------------------------------------------------------------
# Replies
# ---------------------------------------------------------------------------------------------


class Pong(_Message, tag="pong", kw_only=True):
    server_version: str
    pid: int


class Ack(_Message, tag="ack", kw_only=True):
    pass


class ServerConfigInfo(_Message, tag="config", kw_only=True):
    chunk_size: int
    capacity_bytes: int
    policy: str
    metadata_only: bool
    read_lock_ttl_s: float
    session_ttl_s: float


class ServerStats(_Message, tag="stats", kw_only=True):
    num_objects: int
    used_bytes: int
    capacity_bytes: int
    num_locks: int
    num_pins: int
    num_sessions: int
    num_workers: int
    num_pending_lookups: int
    num_inflight_stores: int
    num_inflight_retrieves: int
    evicted_objects: int
    evicted_bytes: int
    expired_locks: int
    stored_bytes: int
    retrieved_bytes: int
    errors: int


class WorkerRegistered(_Message, tag="registered", kw_only=True):
    chunk_size: int
    object_bytes: int
    # Path of the shared-memory pool file to map; empty in metadata-only mode.
    pool_path: str
    pool_bytes: int


class LookupResult(_Message, tag="lookup_result", kw_only=True):
    """``pending`` means: poll again; otherwise ``hit_chunks`` complete chunks are locked."""

    pending: bool = False
    hit_chunks: Count = 0
    num_locks: Count = 0


class LocksFreed(_Message, tag="locks_freed", kw_only=True):
    num_chunks: int
    num_locks: int


class Slot(msgspec.Struct, array_like=True):
    offset: int
    nbytes: int


class ItemSlots(msgspec.Struct, kw_only=True):
    """Per chunk of an item: where to copy, or ``None`` (store: skip; retrieve: missing)."""

    slots: list[Slot | None]
    num_present: int = 0
    num_full: int = 0


class StorePlan(_Message, tag="store_plan", kw_only=True):
    store_id: int
    items: list[ItemSlots]
    evicted_objects: int = 0


class StoreDone(_Message, tag="store_done", kw_only=True):
    num_committed: int
    num_aborted: int


class RetrievePlan(_Message, tag="retrieve_plan", kw_only=True):
    retrieve_id: int
    items: list[ItemSlots]


class RetrieveDone(_Message, tag="retrieve_done", kw_only=True):
    num_locks_released: int


class Dropped(_Message, tag="dropped", kw_only=True):
    num_objects: int
    num_bytes: int
    num_locks_released: int


ErrorCode = Literal[
    "malformed",
    "too_large",
    "version",
    "not_registered",
    "unknown_id",
    "conflict",
    "invalid",
    "internal",
]


class Error(_Message, tag="error", kw_only=True):
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
    | Dropped
    | Error
)

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


def encode(message: _Message) -> bytes:
    return _encoder.encode(message)


def decode_request(frame: bytes) -> Request:
    """Decodes one request frame; raises ``msgspec.DecodeError`` / ``ValidationError``."""
    return _request_decoder.decode(frame)


def decode_reply(frame: bytes) -> Reply:
    return _reply_decoder.decode(frame)
