"""Cache server configuration: one frozen dataclass, validated, with LMCache's defaults."""

from __future__ import annotations

from dataclasses import dataclass

from server.policies import POLICIES

DEFAULT_PORT = 5555


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    """Interface to bind. Loopback by default; use 0.0.0.0 only on a trusted network."""

    port: int = DEFAULT_PORT
    """TCP port; 0 lets the OS choose (the readiness line prints the bound endpoint)."""

    chunk_size: int = 256
    """Tokens per cached chunk; clients read it from the server and must use it."""

    capacity_bytes: int = 1 << 30
    """Upper bound on the bytes of all objects, reserved or committed. Never exceeded."""

    metadata_only: bool = False
    """Account objects by size but allocate no pool and copy no bytes (capacity sweeps)."""

    policy: str = "lru"
    """Eviction policy name (see ``server.policies.POLICIES``)."""

    read_lock_ttl_s: float = 300.0
    """A lookup's read lock is released after this long if no retrieve or free came."""

    session_ttl_s: float = 600.0
    """A session (request) idle this long is forgotten, as if it had been ended."""

    client_timeout_s: float = 60.0
    """A client silent this long is reaped: locks released, stores aborted, pins dropped."""

    lookup_pending_timeout_s: float = 2.0
    """How long a lookup may stay pending on an in-flight store before it settles."""

    max_message_bytes: int = 64 << 20
    """Frames larger than this get a ``too_large`` error reply."""

    reap_interval_s: float = 0.1
    """How often TTLs and liveness are checked."""

    def __post_init__(self) -> None:
        problems = []
        if not 0 <= self.port <= 65535:
            problems.append(f"port must be in 0..65535, got {self.port}")
        if self.chunk_size <= 0:
            problems.append(f"chunk_size must be positive, got {self.chunk_size}")
        if self.capacity_bytes <= 0:
            problems.append(f"capacity_bytes must be positive, got {self.capacity_bytes}")
        if self.policy not in POLICIES:
            problems.append(f"unknown policy {self.policy!r}; choose one of {sorted(POLICIES)}")
        for name in (
            "read_lock_ttl_s",
            "session_ttl_s",
            "client_timeout_s",
            "lookup_pending_timeout_s",
            "reap_interval_s",
        ):
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_message_bytes < 1024:
            problems.append(
                f"max_message_bytes must be at least 1024, got {self.max_message_bytes}"
            )
        if problems:
            raise ValueError("invalid server config: " + "; ".join(problems))
