"""Span names and attribute names: the vocabulary of every trace the testbed writes.

Defined once here and documented in METRICS.md; instrumentation and analysis both import
these constants, so a renamed attribute cannot silently break a notebook.
"""

from __future__ import annotations

# --- span names -------------------------------------------------------------------------------
REQUEST = "kvcache.request"
CONNECTOR_LOOKUP = "kvcache.connector.lookup"
CONNECTOR_STORE = "kvcache.connector.store"
CONNECTOR_RETRIEVE = "kvcache.connector.retrieve"
CONNECTOR_LOCK_RELEASE = "kvcache.connector.lock_release"
CONNECTOR_END_SESSION = "kvcache.connector.end_session"
CONNECTOR_REQUEST = "kvcache.connector.request"
CONNECTOR_REGISTER = "kvcache.connector.register"
CONNECTOR_OUTAGE = "kvcache.connector.outage"
CONNECTOR_ABORT = "kvcache.connector.abort"
SERVER_LOOKUP = "kvcache.server.lookup"
SERVER_STORE = "kvcache.server.store"
SERVER_RETRIEVE = "kvcache.server.retrieve"
SERVER_LOCK_RELEASE = "kvcache.server.lock_release"
SERVER_END_SESSION = "kvcache.server.end_session"
SERVER_REGISTER = "kvcache.server.register"
SERVER_EVICT = "kvcache.server.evict"
SERVER_LOCK_EXPIRE = "kvcache.server.lock_expire"
SERVER_ABORT = "kvcache.server.abort"
SERVER_OP_EXPIRE = "kvcache.server.op_expire"
SERVER_CLIENT_GONE = "kvcache.server.client_gone"
SERVER_SET_PEERS = "kvcache.server.set_peers"
SERVER_PEER_FETCH = "kvcache.server.peer_fetch"  # a lookup's copy from a peer (server.peering)
SERVER_PEER_PROBE = "kvcache.server.peer_probe"  # a peer asked what this server holds
SERVER_PEER_SERVE = "kvcache.server.peer_serve"  # a peer fetched objects from this server
SERVER_TIER_READ = "kvcache.server.tier_read"  # one object read from a tier below L1
SERVER_TIER_WRITE = "kvcache.server.tier_write"  # one object written to a tier below L1
SERVER_TIER_PREFETCH = "kvcache.server.tier_prefetch"  # a lookup's chunks brought up into L1
SERVER_TIER_PROMOTE = "kvcache.server.tier_promote"  # an object read below L1 committed in L1
SERVER_TIER_DEMOTE = "kvcache.server.tier_demote"  # L1 evictions written down (write_back)
SERVER_TIER_EVICT = "kvcache.server.tier_evict"  # a tier below L1 evicting to make room

# --- common ---------------------------------------------------------------------------------
OP = "kvcache.op"  # the protocol message a server span handled (lookup, store_begin, ...)
SESSION_ID = "kvcache.session_id"  # the engine's request id, namespaced by engine
REQUEST_ID = "kvcache.request_id"
REQUEST_IDS = "kvcache.request_ids"  # batched connector ops: one entry per item
SESSION_IDS = "kvcache.session_ids"  # batched server ops: one entry per item
OP_ID = "kvcache.op_id"  # client-chosen id of a store or retrieve
EPOCH = "kvcache.server.epoch"  # the server instance
CLIENT = "kvcache.client"  # the server's name for a client connection (hex routing id)
NUM_REQUESTS = "kvcache.num_requests"
OK = "kvcache.ok"
ERROR = "kvcache.error"
KV_RANK = "kvcache.kv_rank"
WORLD_SIZE = "kvcache.world_size"
MODEL = "kvcache.model"

# --- counts -----------------------------------------------------------------------------------
TOKENS_REQUESTED = "kvcache.tokens.requested"
TOKENS_HIT = "kvcache.tokens.hit"
TOKENS_HIT_HOST = "kvcache.tokens.hit.host"  # of the hit, tokens matched in L1 (at match time)
TOKENS_HIT_DISK = "kvcache.tokens.hit.disk"  # ... matched in the disk tier
TOKENS_HIT_REMOTE = "kvcache.tokens.hit.remote"  # ... matched in the remote store
TOKENS_HIT_P2P = "kvcache.tokens.hit.p2p"  # ... matched in a peer server
TOKENS_HIT_BY_SOURCE = {
    "host": TOKENS_HIT_HOST,
    "disk": TOKENS_HIT_DISK,
    "remote": TOKENS_HIT_REMOTE,
    "p2p": TOKENS_HIT_P2P,
}
CHUNKS_REQUESTED = "kvcache.chunks.requested"
CHUNKS_HIT = "kvcache.chunks.hit"
TOKENS = "kvcache.tokens"
CHUNKS = "kvcache.chunks"
CHUNKS_PRESENT = "kvcache.chunks.present"  # store: already stored, skipped
CHUNKS_FULL = "kvcache.chunks.full"  # store: no room (all else locked)
CHUNKS_MISSING = "kvcache.chunks.missing"  # retrieve: gone since the lookup
CHUNKS_WRITTEN = "kvcache.chunks.written"
BYTES = "kvcache.bytes"
BLOCKS = "kvcache.blocks"
SKIP_FIRST_N_TOKENS = "kvcache.skip_first_n_tokens"
NUM_READERS = "kvcache.num_readers"
LOCKS_TAKEN = "kvcache.locks.taken"
LOCKS_RELEASED = "kvcache.locks.released"
RANGE_START = "kvcache.range.start_token"
RANGE_END = "kvcache.range.end_token"
LOOKUP_PENDING = "kvcache.lookup.pending"
LOOKUP_POLLS = "kvcache.lookup.polls"
MIRROR_HIT_CHUNKS = "kvcache.mirror.hit_chunks"  # the scheduler's mirror's predicted hit
MIRROR_ANSWERED = "kvcache.mirror.answered"  # the mirror answered (a miss), not the server
MIRROR_WRONG_TOKENS = "kvcache.mirror.wrong_tokens"  # held beyond its answer and vLLM's own hit
WAIT_MS = "kvcache.wait_ms"
COPY_MS = "kvcache.copy_ms"
SERVER_MS = "kvcache.server_ms"  # request sent → reply arrived (round trips, server work)
POLL_WAIT_MS = "kvcache.poll_wait_ms"  # reply arrived → taken by the scheduler's/worker's next call
# server_ms split by the server's stamps (testbed.core.round_trips; one host's clock):
REQUEST_TRANSIT_MS = "kvcache.rpc.request_transit_ms"  # sent → the server read the request
HANDLER_MS = "kvcache.rpc.handler_ms"  # the server read it → sent the reply
REPLY_READ_MS = "kvcache.rpc.reply_read_ms"  # the server sent the reply → read off the socket
STEP_WAIT_MS = "kvcache.step_wait_ms"  # the engine's step blocked on this store's replies
SERVER_COPIED = "kvcache.server_copied"  # server-driven transfer: the server did the copy
TRANSFER_MODE = "kvcache.transfer_mode"  # worker | server
HELD_MS = "kvcache.lock.held_ms"
EVICTED_OBJECTS = "kvcache.evicted.objects"
EVICTED_BYTES = "kvcache.evicted.bytes"
EVICT_REASON = "kvcache.evict.reason"
POLICY = "kvcache.policy"
USED_BYTES = "kvcache.used_bytes"
CAPACITY_BYTES = "kvcache.capacity_bytes"
SERVER_URL = "kvcache.server.url"
OUTAGE_S = "kvcache.outage_s"
MISS_STATUS = "kvcache.lookup.miss_status"  # a MissStatus (protocol): why the hit ended
INDEX_BYTES = "kvcache.index_bytes"  # estimated index memory outside the pool
REASON = "kvcache.reason"
OPS = "kvcache.ops"
ABANDONED = "kvcache.abandoned"  # a release or abort of an operation the client gave up on
PEERS = "kvcache.peers"  # the peer servers a server asks (their URLs, or how many)
PEER = "kvcache.peer"  # the peer a copy came from (its name: a fleet's "instance N"; or URL)
PEER_WAIT_MS = "kvcache.peer.wait_ms"  # probes + fetch, as the lookup waited for them
PEER_OUTCOME = "kvcache.peer.outcome"  # copied | failed
TIER = "kvcache.tier"  # L2, L3, ...: the level below L1 an operation touched
TIER_KIND = "kvcache.tier.kind"  # disk | remote | p2p: the tier's hit-source name
TIER_CAUSE = "kvcache.tier.cause"  # full | io_error | corrupt | unavailable | slow | dropped
TIER_WRITE_POLICY = "kvcache.tier.write_policy"  # write_through | write_back | selective:N
TIER_PROMOTE_POLICY = "kvcache.tier.promote_policy"  # none | retain
PREFETCH_POLICY = "kvcache.tier.prefetch_policy"  # wait | best_effort | timeout:S
HIT_CHUNKS_BY_TIER = "kvcache.lookup.hit_chunks_by_tier"  # per hit source: host=N,disk=M

# --- request (engine) -------------------------------------------------------------------------
PROMPT_TOKENS = "kvcache.request.prompt_tokens"
REQUEST_GROUP = "kvcache.request.group"  # conversation / document of the workload
ENGINE_HIT_TOKENS = "kvcache.request.engine_hit_tokens"
OUTPUT_TOKENS = "kvcache.request.output_tokens"
PREEMPTIONS = "kvcache.request.preemptions"
TTFT_MS = "kvcache.request.ttft_ms"
REQUEST_FINISHED = "kvcache.request.finished"  # connector: False if the engine shut down first
REQUEST_ATTEMPT = "kvcache.request.attempt"  # which admission planned an op (0: the first)
INTEGRITY_ERRORS = "kvcache.request.integrity_errors"
ARRIVAL_S = "kvcache.request.arrival_s"
SCHEDULED_S = "kvcache.request.scheduled_s"  # first scheduled (engine clock): queueing ends
VLLM_CACHED_TOKENS = "kvcache.request.vllm_cached_tokens"  # serve: usage.cached_tokens
CLIENT_REQUEST_ID = "kvcache.request.client_id"  # serve: the response's id, as a client sees it
PROMISED_TOKENS = "kvcache.load.promised_tokens"  # L: tokens vLLM agreed to load
FIRST_FAILED_TOKEN = "kvcache.load.first_failed_token"  # first token of the first failed block
LOOKUP_STATUS = "kvcache.lookup.status"  # ok | unavailable | none
BLOCK_SIZE = "kvcache.block_size"
BYTES_PER_TOKEN = "kvcache.bytes_per_token"  # register: KV bytes one rank holds per token
OBJECT_BYTES = "kvcache.object_bytes"  # register: bytes of one chunk object of the rank

# --- fleet ------------------------------------------------------------------------------------
ROUTE = "kvcache.route"  # span: one routing decision (child of the request's span)
INSTANCE = "kvcache.instance"  # the fleet instance a span belongs to (request: where it went)
INSTANCES = "kvcache.instances"  # resource: the fleet's size
ROUTER = "kvcache.route.router"
ROUTE_COSTS = "kvcache.route.costs"  # per instance, the router's cost (the lowest wins)
ROUTE_CACHED_TOKENS = "kvcache.route.cached_tokens"  # per instance, prefix its cache held
ROUTE_LOAD_TOKENS = "kvcache.route.load_tokens"  # per instance, queued + running tokens
ROUTE_CLOCK_S = "kvcache.route.clock_s"  # the engine clock at the decision

# --- resource ---------------------------------------------------------------------------------
SERVICE_NAME = "service.name"
SERVICE_INSTANCE_ID = "service.instance.id"
RUN_ID = "kvcache.run_id"
RANK = "kvcache.rank"
CHUNK_SIZE = "kvcache.chunk_size"
TP_SIZE = "kvcache.tp_size"
MLA = "kvcache.mla"
WORKLOAD = "kvcache.workload"
ENGINE = "kvcache.engine"

# --- span events on batched spans (one per item) -----------------------------------------------
ITEM_EVENT = "kvcache.item"
