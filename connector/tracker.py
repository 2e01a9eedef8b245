"""Per-request state on the scheduler side: plain data and its state machine.

::

    LOOKUP ──(alloc, something to load)──► LOAD_PENDING ──(retrieve planned)──► READY
       │                                                                          ▲
       └──────────────────(alloc, nothing to load)────────────────────────────────┘
    any ──(preempted)──► LOOKUP  (blocks gone; a new lookup runs when it is rescheduled)

A tracker is created the first time vLLM asks how many tokens the cache has for a request
and forgotten when the request finishes.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from testbed.core.keys import ChunkHash, KeyExtras


@dataclass(frozen=True)
class Admission:
    """One admission of a request: the facts its accounting is computed from."""

    engine_hit_tokens: int
    """vLLM's own prefix-cache hit (E)."""
    server_hit_tokens: int | None
    """The cache server's chunk-aligned hit (H); ``None`` if the lookup failed."""
    promised_tokens: int
    """Tokens vLLM agreed to load from the cache (L)."""
    lookup_status: str
    """``ok``, ``unavailable`` (down, timed out, an error), ``refused`` (a limit or quota of
    the server) or ``none`` (no complete chunk)."""
    hit_tokens_by_source: dict[str, int] = field(default_factory=dict)
    """Of the server's hit, tokens each tier held at match time (hit-source name -> tokens;
    empty: all L1's)."""


class Phase(enum.Enum):
    LOOKUP = enum.auto()
    LOAD_PENDING = enum.auto()
    READY = enum.auto()


@dataclass
class RequestTracker:
    request_id: str
    session_id: str
    token_ids: Sequence[int]
    """Live view of the request's tokens (prompt, then generated tokens)."""
    num_prompt_tokens: int
    cache_salt: str
    traceparent: str
    """The request's own trace context; connector spans and worker ops hang under it."""
    chunk_hashes: list[ChunkHash]
    """Hashes of the complete chunks hashed so far (the prompt's, at creation)."""
    key_extras: KeyExtras | None = None
    """What besides the tokens keys the request's chunks (LoRA adapter, multimodal inputs)."""

    phase: Phase = Phase.LOOKUP
    lookup_submitted: bool = False
    hit_tokens: int | None = None
    """Chunk-aligned external hit; ``None`` until the lookup is answered."""
    hit_tokens_by_source: dict[str, int] = field(default_factory=dict)
    """Of ``hit_tokens``, the tokens each tier held at match time (``host``, ``disk``, ...)."""
    lookup_ok: bool = True
    """Whether the lookup was answered (False: server down, timed out or refused)."""
    lookup_refused: bool = False
    """Whether the server refused the lookup for a limit or a quota (``lookup_ok`` False)."""
    handle: bytes = b""
    """The server's name for the lookup's lock group (workers release its locks with it)."""
    engine_hit_tokens: int = 0
    """Tokens the engine's own prefix cache held when the request was allocated."""
    locks_held: bool = False
    """The lookup's read locks are taken and not yet handed to a free or a retrieve."""
    block_ids: list[int] = field(default_factory=list)
    num_stored_chunks: int = 0
    """Chunks known to be in the cache or already planned for storing."""
    preemptions: int = 0
    """Times the engine started the request over: the current admission's ``attempt``."""
    stores_planned: bool = False
    """Whether any store was planned (its blocks must outlive the request until stored)."""
    deferred_tokens: int | None = None
    """Tokens computed in a step that also loaded the request synchronously: their chunks are
    stored only once the step reported the load good (a failed load makes vLLM recompute
    them, and KV computed over blocks that never arrived must not reach the cache)."""
    first_admission: Admission | None = None
    """What the request got at its first admission (the accounting counts that one)."""

    def reset_after_preemption(self) -> None:
        """The engine dropped the request's blocks: start over from a new lookup."""
        self.phase = Phase.LOOKUP
        self.lookup_submitted = False
        self.hit_tokens = None
        self.hit_tokens_by_source = {}
        self.lookup_ok = True
        self.lookup_refused = False
        self.handle = b""
        self.engine_hit_tokens = 0
        self.locks_held = False
        self.block_ids = []
        self.num_stored_chunks = 0
        self.deferred_tokens = None
        self.preemptions += 1
