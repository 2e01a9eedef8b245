"""What the scheduler side tells the workers to do in one step: plain data, no vLLM types.

Token ranges are half-open ``[start_token, end_token)`` over the request's token sequence and
always cover whole chunks; ``block_ids`` are the vLLM blocks covering exactly that range.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from testbed.core.keys import ChunkHash


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkOp:
    """A contiguous run of one request's chunks and the blocks that hold them."""

    request_id: str
    session_id: str
    cache_salt: str
    chunk_hashes: list[ChunkHash]
    first_chunk: int
    start_token: int
    end_token: int
    block_ids: list[int]
    traceparent: str = ""
    """The request's connector span: worker spans hang under it."""
    handle: bytes = b""
    """The lock group of the request's lookup (the server's capability for its locks)."""
    attempt: int = 0
    """Which admission of the request planned the op (0: the first; later ones follow a
    preemption or a restart after a failed load)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreOp(ChunkOp):
    """Copy the blocks into the cache (chunks already there are skipped by the server)."""

    after_lookup: bool = False
    """The request's lookup was sent in this step without waiting for its answer (the lookup
    mirror answered it): the server handles this store only after that lookup."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RetrieveOp(ChunkOp):
    """Copy the chunks from the cache into the blocks."""

    skip_first_n_tokens: int = 0
    """Tokens at the start of the range the engine already holds (its own prefix cache):
    their blocks are shared with other requests and must not be written."""


@dataclass(slots=True)
class StepPlan:
    """Everything the workers must do in one engine step."""

    retrieves: list[RetrieveOp] = field(default_factory=list)
    stores: list[StoreOp] = field(default_factory=list)
    delayed_request_ids: list[str] = field(default_factory=list)
    """Requests that finished with stores possibly in flight: vLLM keeps their blocks until
    every worker reports them in ``finished_sending`` (once their stores completed)."""
    cancelled_request_ids: list[str] = field(default_factory=list)
    """Requests preempted since the last step: their blocks may be reused, so stores not yet
    copied are abandoned."""

    def __len__(self) -> int:
        return len(self.retrieves) + len(self.stores)


class FinishingOrder(set[str]):
    """Request ids that iterate in the order they were given, not in hash order.

    vLLM frees the blocks of the requests in ``finished_sending`` in the order it iterates
    the set, and that order decides which blocks its own prefix cache evicts first. A plain
    set iterates in hash order, and vLLM gives every request id a random suffix, so the same
    workload would evict differently from run to run. Members added later (vLLM does not add
    any) iterate after the ordered ones, in set order.
    """

    def __init__(self, request_ids: Iterable[str] = ()) -> None:
        ordered = list(dict.fromkeys(request_ids))
        super().__init__(ordered)
        self._order = ordered

    def __iter__(self) -> Iterator[str]:
        seen = set()
        for request_id in self._order:
            if set.__contains__(self, request_id):
                seen.add(request_id)
                yield request_id
        if len(seen) < len(self):
            yield from (r for r in set.__iter__(self) if r not in seen)

    def __reduce__(self) -> tuple[type, tuple[list[str]]]:
        return (type(self), (list(self),))
