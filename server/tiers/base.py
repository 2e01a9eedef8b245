"""The lower-tier store: what a tier below L1 must do, and nothing more (a Protocol).

A store only stores bytes under a key. What it holds, in which order it evicts, what is
locked or being read, its capacity accounting and every write and promotion policy belong to
the hierarchy (``server.tiers.hierarchy``), which calls the store from the cache server's
process. Integrity is not the store's: every object carries its checksum inside its bytes
(the hierarchy frames and verifies them), so a store that returns wrong bytes is caught as a
read failure, never served.

Contract of every method: it never raises for a failure of the medium (a full disk, an I/O
error, a lost connection); it answers ``None``/``False`` and records why in
:attr:`LowerTierStore.last_failure` (one of :data:`FAILURE_CAUSES`), so that the hierarchy counts
the loss with its cause and the server goes on. ``kind`` is the tier's name as a hit source in
vLLM's terms (``disk``, ``remote``, ``p2p``); L1 is ``host``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, Protocol, runtime_checkable

from testbed.core.keys import ChunkHash

HitSource = Literal["host", "disk", "remote", "p2p"]
HIT_SOURCES: tuple[HitSource, ...] = ("host", "disk", "remote", "p2p")
"""vLLM's names of where a hit was served from, L1 first."""
L1_SOURCE: HitSource = "host"

FailureCause = Literal["full", "io_error", "corrupt", "unavailable", "slow"]
FAILURE_CAUSES: tuple[FailureCause, ...] = ("full", "io_error", "corrupt", "unavailable", "slow")
"""Why a store's read or write failed: no space on the medium, an I/O error, bytes that did
not verify, a store that cannot be reached, an operation past its deadline."""


@runtime_checkable
class LowerTierStore(Protocol):
    """Bytes under keys on one medium below L1. Single-threaded use: the hierarchy calls one
    method at a time (from its I/O thread for reads and writes)."""

    kind: str
    """The hit-source name (``disk``, ``remote``)."""
    capacity_bytes: int
    """The payload bytes the hierarchy may keep here (its accounting; the store may use more
    on the medium for framing)."""
    last_failure: FailureCause | None
    """Why the last failed call failed (``None`` before any failure)."""

    def used_bytes(self) -> int:
        """Payload bytes held now."""
        ...

    def contains(self, key: ChunkHash) -> bool:
        """Whether ``key`` is held (no read of its bytes)."""
        ...

    def read(self, key: ChunkHash) -> bytes | None:
        """The bytes written under ``key``; ``None`` when absent or failed (cause recorded)."""
        ...

    def write(self, key: ChunkHash, data: bytes) -> bool:
        """Store ``data`` under ``key`` (replacing any); ``False`` on failure (cause recorded,
        nothing partial left readable)."""
        ...

    def remove(self, key: ChunkHash) -> None:
        """Forget ``key`` (absent: nothing to do)."""
        ...

    def keys(self) -> Iterable[ChunkHash]:
        """Every key held."""
        ...

    def close(self) -> None:
        """Release the medium (files closed, connections dropped); idempotent."""
        ...
