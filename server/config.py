"""Cache server configuration: one frozen dataclass, validated, with LMCache's defaults.

Every limit below bounds memory outside the pool or the time one request may hold the
single-threaded server; a request beyond a limit gets an ``Error`` reply with code ``limit``
(a server-wide limit) or ``quota`` (one client's share, ``*_per_client``) that names the limit
and its flag, and the server goes on. Numeric fields declare their ranges in their annotations
(:mod:`testbed.core.bounds`; :data:`BOUNDS` lists them), checked when the config is made.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from server.auth import is_loopback
from server.tiers.policies import check_promote, parse_prefetch, parse_write
from server.tiers.spec import parse_tier
from testbed.core.bounds import Bound, bound_problems, field_bounds
from testbed.core.policies import POLICIES
from testbed.core.protocol import POOL_MEDIA, PoolMedium

DEFAULT_PORT = 5555
PREFAULT_ALL = 1 << 50
"""``prefault_bytes`` that covers any pool: every pool is mapped at start (the default)."""
_HOUR_S = 3600.0
_DAY_S = 24 * _HOUR_S


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    """Interface to bind. Loopback by default; any other interface requires CURVE
    (``curve_dir``), since tokens would otherwise cross the network in clear text."""

    port: Annotated[int, Bound(0, 65535)] = DEFAULT_PORT
    """TCP port; 0 lets the OS choose (the readiness line prints the bound endpoint)."""

    metrics_port: Annotated[int | None, Bound(0, 65535)] = None
    """Serve Prometheus metrics (METRICS.md) over HTTP at /metrics on this port of ``host``; 0
    lets the OS choose (the readiness line prints ``metrics=URL``); None: no endpoint."""

    chunk_size: Annotated[int, Bound(1, 1 << 16, "tokens")] = 256
    """Tokens per cached chunk; clients read it from the server and must use it."""

    capacity_bytes: Annotated[int, Bound(1, 1 << 50, "bytes")] = 1 << 30
    """Upper bound on the bytes of all objects, reserved or committed. Never exceeded."""

    metadata_only: bool = False
    """Account objects by size but allocate no pool and copy no bytes (capacity sweeps)."""

    pool_medium: PoolMedium | None = None
    """Where the pool lives (``server.pools``): ``shm`` (``/dev/shm``), ``disk``
    (``pool_dir``), ``pinned-host`` (page-locked shared memory) or ``gpu`` memory; ``None``:
    ``pinned-host`` where a CUDA device is visible, else ``shm``. Its bytes are reserved at
    start; a pool that does not fit is refused, never moved elsewhere."""

    pool_dir: Path | None = None
    """The directory of a ``disk`` pool (default: the temporary directory)."""

    pool_device: Annotated[int, Bound(0, 1 << 10)] = 0
    """The GPU (local index) of a ``gpu`` pool."""

    policy: str = "lru"
    """Eviction policy name (see ``testbed.core.policies.POLICIES``)."""

    read_lock_ttl_s: Annotated[float, Bound(1e-3, _DAY_S, "s")] = 300.0
    """A lookup's read locks are released after this long if no retrieve or free came."""

    session_ttl_s: Annotated[float, Bound(1e-3, _DAY_S, "s")] = 600.0
    """A session (request) idle this long is forgotten, as if it had been ended."""

    client_timeout_s: Annotated[float, Bound(1e-3, _DAY_S, "s")] = 60.0
    """A client silent this long is reaped: locks released, stores aborted, pins dropped."""

    lookup_pending_timeout_s: Annotated[float, Bound(1e-3, _HOUR_S, "s")] = 2.0
    """How long a lookup may stay pending on an in-flight store before it settles."""

    op_ttl_s: Annotated[float, Bound(1e-3, _DAY_S, "s")] = 30.0
    """Deadline of a store reservation or retrieve pin: an operation its client never
    finished (nor aborted) is expired after this long (reservation dropped, pins and the
    item's lock units released)."""

    max_message_bytes: Annotated[int, Bound(1024, 1 << 31, "bytes")] = 64 << 20
    """Frames larger than this get a ``too_large`` error reply."""

    max_chunks_per_request: Annotated[int, Bound(1, 1 << 24, "chunks")] = 1 << 14
    """Chunks one lookup, store or retrieve may name (all items together)."""

    max_sessions: Annotated[int, Bound(1, 1 << 24, "sessions")] = 1 << 16
    """Live sessions on the server."""

    max_sessions_per_client: Annotated[int, Bound(1, 1 << 24, "sessions")] = 1 << 14
    """Live sessions one client connection may own (a quota)."""

    max_tracked_chunks_per_client: Annotated[int | None, Bound(1, 1 << 30, "chunks")] = None
    """Chunks one client may have tracked at once: in its lock groups and its sessions'
    refresh lists (a quota, so that no client can take the whole table of
    ``max_tracked_chunks``); ``None``: a quarter of ``max_tracked_chunks``."""

    max_pending_lookups_per_client: Annotated[int, Bound(0, 1 << 20, "lookups")] = 1024
    """Lookups of one client left pending on in-flight stores at once; over it a lookup is
    answered at once (its in-flight chunk a miss) instead of waiting."""

    max_inflight_ops_per_client: Annotated[int, Bound(1, 1 << 20, "operations")] = 1024
    """Stores and retrieves one client may have begun and not finished (a quota)."""

    auth_timeout_s: Annotated[float, Bound(1e-3, _HOUR_S, "s")] = 5.0
    """A connection that has sent no request with a valid credential this long after it was
    accepted is closed (counted as ``unauthenticated_closed``)."""

    max_unauthenticated: Annotated[int | None, Bound(1, 1 << 20, "connections")] = None
    """Connections not yet authenticated that may be open at once (the oldest are closed
    beyond it), so that descriptors stay for authenticated clients; ``None``: a quarter of the
    descriptor limit, at most 256."""

    max_tracked_chunks: Annotated[int, Bound(1, 1 << 30, "chunks")] = 1 << 21
    """Chunks held in lock groups and session refresh lists, over all sessions."""

    min_object_bytes: Annotated[int, Bound(1, 1 << 30, "bytes")] = 4096
    """Smallest object (chunk_size x bytes per token) a worker may register: bounds the number
    of objects, hence the index memory, to capacity / min_object_bytes."""

    prefault_bytes: Annotated[int, Bound(0, PREFAULT_ALL, "bytes")] = PREFAULT_ALL
    """Pools up to this size are mapped at start, before the server says it is ready (the
    readiness line's ``prefault_ms`` is what it took), so no request pays first-touch page
    faults; by default every pool, whatever its size (their memory is reserved when they are
    made in any case: ``server.pool``). 0: never."""

    reap_interval_s: Annotated[float, Bound(1e-3, 60.0, "s")] = 0.1
    """How often TTLs, deadlines and liveness are checked."""

    token_file: Path | None = None
    """Where to keep the client and admin tokens (0600); ``None``: a new file beside the pool."""

    curve_dir: Path | None = None
    """ZeroMQ CURVE keys: ``server.key_secret`` and the allowed clients' public ``*.key``."""

    run_dir: Path | None = None
    """Where the server's telemetry goes: its spans (``RUN_DIR/spans/``, OTLP JSON lines) and
    the chunk event log (``RUN_DIR/chunks/``); ``None``: no chunk log, spans only over OTLP."""

    no_chunk_log: bool = False
    """With ``run_dir``: its spans only, no chunk event log (what the log costs, measured by
    ``kvtb bench``; a run's accounting and what-if read the log, so runs keep it)."""

    tiers: tuple[str, ...] = ()
    """Tiers below L1, in order: ``KIND[@POLICY]:CAPACITY[:WHERE]`` each (``--tier``,
    repeatable; ``disk:8GiB:/data/kv``, ``disk@lfu:512MiB``), see ``server.tiers.spec``."""

    tier_write: str = "write_through"
    """When a chunk goes below L1: ``write_through`` (every chunk, asynchronously),
    ``write_back`` (when L1 evicts it) or ``selective:N`` (after N hits in L1)."""

    tier_promote: str = "none"
    """A hit below L1: ``none`` (copied into L1 for its load only) or ``retain`` (stays)."""

    prefetch: str = "wait"
    """How long a lookup waits for its chunks below L1 to reach L1: ``wait`` (at most
    ``lookup_pending_timeout_s``), ``timeout:S`` or ``best_effort`` (not at all)."""

    tier_dir: Path | None = None
    """Where disk tiers without a directory keep their files (``None``: a temporary directory
    removed when the server stops)."""

    tier_fsync: bool = False
    """Sync every disk-tier file before it counts as written (durable; slower)."""

    tier_direct_io: bool = False
    """Open disk-tier files with ``O_DIRECT`` where the filesystem allows it (bypasses the page
    cache, so reads are the device's speed, not memory's)."""

    tier_delay_s: Annotated[float, Bound(0.0, 60.0, "s")] = 0.0
    """Added to every tier read and write: a slow device, for fault scenarios."""

    max_prefetch_objects: Annotated[int, Bound(1, 1 << 20, "objects")] = 4096
    """Objects being brought up from lower tiers at once; a lookup past it ends its hit at the
    first chunk it could not send for (miss status ``prefetch_timeout``)."""

    max_queued_tier_writes: Annotated[int, Bound(1, 1 << 20, "objects")] = 4096
    """Writes to lower tiers queued at once; past it a write is dropped (counted)."""

    def __post_init__(self) -> None:
        problems = bound_problems(self, flag_name)
        if self.policy not in POLICIES:
            problems.append(
                f"--policy {self.policy!r} is unknown; choose one of {', '.join(sorted(POLICIES))}"
            )
        if self.pool_medium is not None and self.pool_medium not in POOL_MEDIA:
            problems.append(
                f"--pool {self.pool_medium!r} is unknown; choose one of {', '.join(POOL_MEDIA)}"
            )
        elif self.pool_dir is not None and self.pool_medium != "disk":
            problems.append("--pool-dir goes with --pool disk (a shm pool is in /dev/shm)")
        problems += _tier_problems(self)
        if not is_loopback(self.host) and self.curve_dir is None:
            problems.append(
                f"--host {self.host} is not loopback: tokens would cross the network in clear "
                "text; give --curve-dir with CURVE keys (see `kvtb server --help`)"
            )
        if problems:
            raise ValueError("invalid server config: " + "; ".join(problems))

    @property
    def tracked_chunks_quota(self) -> int:
        """``max_tracked_chunks_per_client``, or its default (a quarter of the global limit)."""
        return self.max_tracked_chunks_per_client or max(1, self.max_tracked_chunks // 4)


def _tier_problems(config: ServerConfig) -> list[str]:
    problems = []
    for text, parse in (
        *((tier, parse_tier) for tier in config.tiers),
        (config.tier_write, parse_write),
        (config.prefetch, parse_prefetch),
        (config.tier_promote, check_promote),
    ):
        try:
            parse(text)
        except ValueError as err:
            problems.append(str(err))
    if config.tiers and (config.metadata_only or config.pool_medium == "gpu"):
        problems.append("--tier needs a host pool with bytes (not --metadata-only, not --pool gpu)")
    return problems


BOUNDS: dict[str, Bound] = field_bounds(ServerConfig)
"""The ranges the numeric fields declare (RELIABILITY.md lists the limits)."""

_FLAGS = {
    "tiers": "--tier",
    "capacity_bytes": "--capacity",
    "prefault_bytes": "--prefault",
    "pool_medium": "--pool",
}


def flag_name(name: str) -> str:
    """The ``kvtb server`` flag of field ``name`` (``read_lock_ttl_s``: ``--read-lock-ttl``)."""
    return _FLAGS.get(name) or "--" + name.removesuffix("_s").replace("_", "-")
