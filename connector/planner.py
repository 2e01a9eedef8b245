"""Decisions on the scheduler side: how much to load, which locks to free, what to store.

Pure functions over :class:`connector.tracker.RequestTracker`; no vLLM, no sockets. The rules
(DESIGN.md §2, LMCache's multi-process connector):

- the usable hit is ``max(engine prefix hit, external hit)``, never the sum: the cache only
  loads the part of its hit beyond what the engine already holds;
- the engine always computes the last prompt token, so a hit never covers all tokens;
- a retrieve starts at the chunk holding the engine's hit boundary, ``floor(apc/C)*C``, and
  skips the ``apc - start`` tokens the engine already holds (those blocks are shared);
- locks on chunks the engine holds entirely are freed at once; the rest go with the retrieve;
- only complete chunks of *prompt* tokens are stored (decode tokens only if configured), each
  once, as soon as the engine has computed them (so chunked prefill stores every chunk).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TypeVar

from connector.ops import RetrieveOp, StoreOp
from connector.tracker import Phase, RequestTracker
from testbed.core.keys import extend_chunk_hashes


@dataclass(frozen=True)
class Geometry:
    chunk_size: int
    block_size: int

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.chunk_size <= 0:
            raise ValueError("chunk_size and block_size must be positive")
        if self.chunk_size % self.block_size:
            raise ValueError(
                f"chunk size {self.chunk_size} must be a multiple of the engine's block size "
                f"{self.block_size}"
            )

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_size // self.block_size


def tokens_to_load(hit_tokens: int, num_computed_tokens: int, num_tokens: int) -> int:
    """Tokens the cache can add beyond the engine's ``num_computed_tokens``."""
    usable = min(hit_tokens, num_tokens - 1)
    return max(0, usable - num_computed_tokens)


def lock_release_after_alloc(
    tracker: RequestTracker, num_external_tokens: int, geometry: Geometry
) -> tuple[int, int] | None:
    """Moves a freshly allocated tracker out of LOOKUP; the token range whose locks to free.

    ``num_external_tokens`` is what the engine agreed to load (0 when it will not load).
    """
    assert tracker.phase is Phase.LOOKUP and tracker.hit_tokens is not None
    tracker.num_stored_chunks = tracker.hit_tokens // geometry.chunk_size
    if not tracker.locks_held:
        tracker.phase = Phase.READY
        return None
    tracker.locks_held = False
    if num_external_tokens > 0:
        tracker.phase = Phase.LOAD_PENDING
        # Chunks entirely inside the engine's hit are not retrieved; the chunk that straddles
        # the boundary is, and its retrieve releases its locks.
        end = tracker.engine_hit_tokens
    else:
        tracker.phase = Phase.READY
        end = tracker.hit_tokens
    return (0, end) if end >= geometry.chunk_size else None


def plan_retrieve(tracker: RequestTracker, geometry: Geometry) -> RetrieveOp | None:
    """The retrieve for a LOAD_PENDING tracker (then READY)."""
    if tracker.phase is not Phase.LOAD_PENDING:
        return None
    tracker.phase = Phase.READY
    assert tracker.hit_tokens is not None
    chunk = geometry.chunk_size
    first_chunk = tracker.engine_hit_tokens // chunk
    last_chunk = tracker.hit_tokens // chunk
    if last_chunk <= first_chunk:
        return None
    op = _chunk_op(RetrieveOp, tracker, geometry, first_chunk, last_chunk)
    return replace(op, skip_first_n_tokens=tracker.engine_hit_tokens - first_chunk * chunk)


def plan_store(
    tracker: RequestTracker,
    geometry: Geometry,
    num_computed_tokens: int,
    *,
    store_decode_tokens: bool = False,
) -> StoreOp | None:
    """The store of chunks newly completed by the engine (KV exists up to ``num_computed_tokens``
    once this step ran). With ``store_decode_tokens``, chunks of generated tokens too.

    Updates ``tracker``: its ``num_stored_chunks`` advance to the chunks planned (each chunk
    is planned once), and with ``store_decode_tokens`` its ``chunk_hashes`` grow to the
    generated tokens' complete chunks."""
    chunk = geometry.chunk_size
    limit = min(num_computed_tokens, len(tracker.block_ids) * geometry.block_size)
    if store_decode_tokens:
        limit = min(limit, len(tracker.token_ids))
        extend_chunk_hashes(
            tracker.chunk_hashes, tracker.token_ids, chunk, limit // chunk, tracker.key_extras
        )
    else:
        limit = min(limit, tracker.num_prompt_tokens)
    target = min(limit // chunk, len(tracker.chunk_hashes))
    if target <= tracker.num_stored_chunks:
        return None
    first = tracker.num_stored_chunks
    tracker.num_stored_chunks = target
    return _chunk_op(StoreOp, tracker, geometry, first, target)


Op = TypeVar("Op", StoreOp, RetrieveOp)


def _chunk_op(
    kind: type[Op], tracker: RequestTracker, geometry: Geometry, first_chunk: int, last_chunk: int
) -> Op:
    """An op of ``kind`` over chunks ``[first_chunk, last_chunk)`` of the request."""
    start, end = first_chunk * geometry.chunk_size, last_chunk * geometry.chunk_size
    return kind(
        request_id=tracker.request_id,
        session_id=tracker.session_id,
        cache_salt=tracker.cache_salt,
        chunk_hashes=tracker.chunk_hashes[first_chunk:last_chunk],
        first_chunk=first_chunk,
        start_token=start,
        end_token=end,
        block_ids=tracker.block_ids[start // geometry.block_size : end // geometry.block_size],
        traceparent=tracker.traceparent,
        handle=tracker.handle,
        attempt=tracker.preemptions,
    )
