"""Block-hash traces: requests named by block ids, and the tokens synthesised for them.

Mooncake (``mooncake:PATH``) and kv-cache-tester (``agentic:PATH``) publish no text: a request
is its length and the ids of its blocks of ``block_tokens`` tokens, prefix-chained (the i-th id
names block i *together with everything before it*). Both readers reduce a record to a
:class:`BlockRequest` and share what follows from it:

- **Tokens** (:class:`BlockTokens`): each block id gets one deterministic pseudo-random block of
  ``block_tokens`` token ids, seeded by the workload seed, the id's *scope* and the id. Equal
  ids in one scope give equal tokens; ids of different scopes (kv-cache-tester's ids are local
  to one conversation) never do. A prompt is its blocks concatenated and cut to its length.
- **The tail**: where the trace names the partial last block (Mooncake) it is that block's
  prefix; where it names only complete blocks (kv-cache-tester) the tokens after them come
  from a stream of their own per request (``tail_key``): no other request shares them, so they
  create no hit that the trace does not have.
- **Keys without tokens** (:mod:`testbed.workloads.block_keys`): the chunk keys the server would
  compute from these tokens, derived from the ids alone, for the oracle and the what-if.

Two prompts therefore share exactly the leading tokens their common id prefix covers; every
chunk size that divides the block size, or is a multiple of it, keeps the trace's sharing
exactly. Other chunk sizes split blocks, and a part-block is then shared only when the whole
block is.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from testbed.workloads.base import WorkloadOptions, WorkloadRequest

DEFAULT_CACHE_TOKENS = 16384 * 512
"""Synthesised tokens kept for reuse (32 MiB of int32): shared prefixes (system prompt, tool
definitions, earlier turns) are generated once, not once per request."""

_BLOCK, _TAIL = 0, 1  # what a scoped seed is for: a block's tokens, or a request's tail
_WORD = (1 << 32) - 1


@dataclass(frozen=True, slots=True, eq=False)
class BlockRequest:
    """One request of a block-hash trace, before any token exists.

    It carries the fields a run needs without tokens (``request_id``, ``arrival_s``,
    ``group``, ``num_prompt_tokens``, ``max_output_tokens``, as :class:`WorkloadRequest`), so
    the oracle and the what-if serve block requests where the engines serve token requests.
    ``eq=False``: ``block_ids`` is an array.
    """

    request_id: str
    arrival_s: float
    """Seconds since the workload start."""
    group: str
    """Conversation (and sub-agent) of the request, ``""`` when the trace has none."""
    num_prompt_tokens: int
    max_output_tokens: int
    """Tokens to generate (>= 1; the trace's output length, capped by the options)."""
    block_ids: np.ndarray
    """int64 ids of the prompt's blocks in order, prefix-chained, all of them complete ones
    when ``tail_key`` is set, else covering the prompt with the last one possibly partial."""
    block_tokens: int
    """Tokens per block (512 for Mooncake, the file's ``block_size`` for kv-cache-tester)."""
    scope: int | None = None
    """The ids' namespace (``None``: one namespace for the whole trace); a 64-bit int."""
    tail_key: int | None = None
    """Names the request's own tail stream, unique within its scope; ``None``: the ids cover
    the prompt (the last block may be partial)."""

    def __post_init__(self) -> None:
        blocks, tokens = len(self.block_ids), self.num_prompt_tokens
        expected = tokens // self.block_tokens
        if self.tail_key is None:
            expected = -(-tokens // self.block_tokens)
        if tokens < 1 or blocks != expected:
            raise ValueError(
                f"{self.request_id}: {blocks} block ids for {tokens} prompt tokens in blocks "
                f"of {self.block_tokens}; expected {expected}"
            )

    def with_tokens(self, prompt_token_ids: np.ndarray) -> WorkloadRequest:
        return WorkloadRequest(
            request_id=self.request_id,
            prompt_token_ids=prompt_token_ids,
            max_output_tokens=self.max_output_tokens,
            arrival_s=self.arrival_s,
            group=self.group,
        )


class BlockTokens:
    """Token ids of block requests (contracts in the module docstring), with an LRU of the
    most recently used blocks."""

    def __init__(
        self, seed: int, vocab_size: int, cache_tokens: int = DEFAULT_CACHE_TOKENS
    ) -> None:
        if cache_tokens < 0:
            raise ValueError(f"cache_tokens must be >= 0, got {cache_tokens}")
        self.seed = seed
        self.vocab_size = vocab_size
        self.cache_tokens = cache_tokens
        self._cache: OrderedDict[tuple[int | None, int], np.ndarray] = OrderedDict()
        self._cached_tokens = 0

    def prompt(self, request: BlockRequest) -> np.ndarray:
        """The request's prompt: its blocks, then (``tail_key``) its own tail."""
        size, total = request.block_tokens, request.num_prompt_tokens
        tokens = np.empty(total, dtype=np.int32)
        for index, block_id in enumerate(request.block_ids.tolist()):
            start = index * size
            end = min(start + size, total)
            tokens[start:end] = self._block(request.scope, block_id, size)[: end - start]
        covered = len(request.block_ids) * size
        if covered < total:
            assert request.tail_key is not None  # BlockRequest checks the ids cover the rest
            rng = np.random.default_rng(self._entropy(_TAIL, request.scope, request.tail_key))
            tokens[covered:] = rng.integers(0, self.vocab_size, total - covered, dtype=np.int32)
        return tokens

    def _block(self, scope: int | None, block_id: int, size: int) -> np.ndarray:
        key = (scope, block_id)
        block = self._cache.get(key)
        if block is not None:
            self._cache.move_to_end(key)
            return block
        # One namespace (Mooncake): seeded by (seed, id), as the reader always was.
        entropy = [self.seed, block_id] if scope is None else self._entropy(_BLOCK, scope, block_id)
        block = np.random.default_rng(entropy).integers(0, self.vocab_size, size, dtype=np.int32)
        if size <= self.cache_tokens:
            self._cache[key] = block
            self._cached_tokens += size
            while self._cached_tokens > self.cache_tokens:
                _, dropped = self._cache.popitem(last=False)
                self._cached_tokens -= len(dropped)
        return block

    def _entropy(self, purpose: int, scope: int | None, key: int) -> list[int]:
        """A seed of fixed shape (32-bit words), so that no two (purpose, scope, key) give the
        same words: the purpose keeps tails apart from blocks, the scope conversations."""
        scope = 0 if scope is None else scope
        return [self.seed, purpose, scope >> 32, scope & _WORD, key >> 32, key & _WORD]


class BlockTraceWorkload(ABC):
    """A workload read from a block-hash trace: :meth:`block_requests` is the trace's
    requests as block ids (in arrival order, the options applied); iterating synthesises
    their tokens with :class:`BlockTokens`."""

    kind: str
    options: WorkloadOptions

    @abstractmethod
    def block_requests(self) -> Iterator[BlockRequest]:
        """The requests, in the order and with the ids, arrivals and groups iteration gives."""

    def __iter__(self) -> Iterator[WorkloadRequest]:
        return self.with_tokens(self.block_requests())

    def with_tokens(self, requests: Iterable[BlockRequest]) -> Iterator[WorkloadRequest]:
        """``requests`` (of :meth:`block_requests`) with their tokens, as iteration makes them
        (a request's tokens depend on its ids alone, not on which others are made)."""
        tokens = BlockTokens(self.options.seed, self.options.vocab_size)
        for request in requests:
            yield request.with_tokens(tokens.prompt(request))


# -------------------------------------------------------------------------------------------
# Checks the readers share for their JSON records
# -------------------------------------------------------------------------------------------


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """An int or a finite float (not a bool)."""
    return is_int(value) or (isinstance(value, float) and math.isfinite(value))


def block_id_array(value: object) -> np.ndarray | None:
    """A JSON list of block ids (integers in ``[0, 2**63)``) as int64, or ``None`` when it is
    not one."""
    if not isinstance(value, list):
        return None
    if not value:
        return np.zeros(0, dtype=np.int64)
    try:
        ids = np.array(value)
    except (ValueError, OverflowError):
        return None
    if ids.ndim != 1 or ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= 1 << 63:
        return None
    return ids.astype(np.int64)
