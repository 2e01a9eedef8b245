"""Cache server configuration: one frozen dataclass, validated, with LMCache's defaults.

Every limit below bounds memory outside the pool or the time one request may hold the
single-threaded server; a request beyond a limit gets an ``Error`` reply with code ``limit``
that names the limit and its flag, and the server goes on.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from server.auth import is_loopback
from server.policies import POLICIES
from server.pools import POOL_KINDS, PoolKind

DEFAULT_PORT = 5555


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    """Interface to bind. Loopback by default; any other interface requires CURVE
    (``curve_dir``), since tokens would otherwise cross the network in clear text."""

    port: int = DEFAULT_PORT
    """TCP port; 0 lets the OS choose (the readiness line prints the bound endpoint)."""

    chunk_size: int = 256
    """Tokens per cached chunk; clients read it from the server and must use it."""

    capacity_bytes: int = 1 << 30
    """Upper bound on the bytes of all objects, reserved or committed. Never exceeded."""

    metadata_only: bool = False
    """Account objects by size but allocate no pool and copy no bytes (capacity sweeps)."""

    pool: PoolKind | None = None
    """Where the pool lives (``server.pools``): ``cpu`` shared memory, ``pinned-host``
    page-locked shared memory, or ``gpu`` memory; ``None``: ``pinned-host`` where a CUDA device
    is visible, else ``cpu``."""

    pool_device: int = 0
    """The GPU (local index) of a ``gpu`` pool."""

    policy: str = "lru"
    """Eviction policy name (see ``server.policies.POLICIES``)."""

    read_lock_ttl_s: float = 300.0
    """A lookup's read locks are released after this long if no retrieve or free came."""

    session_ttl_s: float = 600.0
    """A session (request) idle this long is forgotten, as if it had been ended."""

    client_timeout_s: float = 60.0
    """A client silent this long is reaped: locks released, stores aborted, pins dropped."""

    lookup_pending_timeout_s: float = 2.0
    """How long a lookup may stay pending on an in-flight store before it settles."""

    op_ttl_s: float = 30.0
    """Deadline of a store reservation or retrieve pin: an operation its client never
    finished (nor aborted) is expired after this long (reservation dropped, pins and the
    item's lock units released)."""

    max_message_bytes: int = 64 << 20
    """Frames larger than this get a ``too_large`` error reply."""

    max_chunks_per_request: int = 1 << 14
    """Chunks one lookup, store or retrieve may name (all items together)."""

    max_sessions: int = 1 << 16
    """Live sessions on the server."""

    max_sessions_per_client: int = 1 << 14
    """Live sessions one client connection may own."""

    max_tracked_chunks: int = 1 << 21
    """Chunks held in lock groups and session refresh lists, over all sessions."""

    min_object_bytes: int = 4096
    """Smallest object (chunk_size x bytes per token) a worker may register: bounds the number
    of objects, hence the index memory, to capacity / min_object_bytes."""

    prefault_bytes: int = 512 << 20
    """Pools up to this size are allocated and mapped at start (the readiness line says how
    long it took), so stores pay no first-touch page faults; larger pools, e.g. the
    "unlimited" capacity of a long trace, fill lazily. 0: never."""

    reap_interval_s: float = 0.1
    """How often TTLs, deadlines and liveness are checked."""

    token_file: Path | None = None
    """Where to keep the client and admin tokens (0600); ``None``: a new file beside the pool."""

    curve_dir: Path | None = None
    """ZeroMQ CURVE keys: ``server.key_secret`` and the allowed clients' public ``*.key``."""

    run_dir: Path | None = None
    """Where the chunk event log goes (``RUN_DIR/chunks/``); ``None``: no chunk log."""

    def __post_init__(self) -> None:
        problems = []
        if not 0 <= self.port <= 65535:
            problems.append(f"--port must be in 0..65535, got {self.port}")
        if self.chunk_size <= 0:
            problems.append(f"--chunk-size must be positive, got {self.chunk_size}")
        if self.capacity_bytes <= 0:
            problems.append(f"--capacity must be positive, got {self.capacity_bytes}")
        if self.pool is not None and self.pool not in POOL_KINDS:
            problems.append(
                f"--pool {self.pool!r} is unknown; choose one of {', '.join(POOL_KINDS)}"
            )
        if self.pool_device < 0:
            problems.append(f"--pool-device must not be negative, got {self.pool_device}")
        if self.policy not in POLICIES:
            problems.append(
                f"--policy {self.policy!r} is unknown; choose one of {', '.join(sorted(POLICIES))}"
            )
        for name in (
            "read_lock_ttl_s",
            "session_ttl_s",
            "client_timeout_s",
            "lookup_pending_timeout_s",
            "op_ttl_s",
            "reap_interval_s",
        ):
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_message_bytes < 1024:
            problems.append(
                f"--max-message-bytes must be at least 1024, got {self.max_message_bytes}"
            )
        for name in (
            "max_chunks_per_request",
            "max_sessions",
            "max_sessions_per_client",
            "max_tracked_chunks",
            "min_object_bytes",
        ):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be at least 1, got {getattr(self, name)}")
        if not is_loopback(self.host) and self.curve_dir is None:
            problems.append(
                f"--host {self.host} is not loopback: tokens would cross the network in clear "
                "text; give --curve-dir with CURVE keys (see `kvtb server --help`)"
            )
        if problems:
            raise ValueError("invalid server config: " + "; ".join(problems))
