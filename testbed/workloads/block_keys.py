"""Chunk keys of block requests, from their block ids alone (no token is synthesised).

The server keys a prompt's complete chunks of ``C`` tokens by a rolling prefix hash of their
tokens (``testbed.core.keys``). For the tokens :class:`~testbed.workloads.block_trace.BlockTokens`
synthesises, the first ``e`` tokens of two prompts are equal exactly when

- the block covering token ``e - 1`` has an id in both and the two prompts' id prefixes up to
  and including that block are equal (the block's tokens are a function of its id, and ids are
  prefix-chained); or
- never, when that block has no id (a kv-cache-tester tail is the request's own).

So the chunk ending at token ``e`` is named by (the dense id of the id prefix up to block
``b = (e - 1) // B``, ``e - b B``), or by a key of its own when block ``b`` has no id: equal
for two chunks exactly when their chunk hashes are equal (a collision of random token blocks
aside). :class:`BlockKeys` numbers the id prefixes once; :meth:`BlockKeys.at` keys every chunk
size from them with array arithmetic (an :class:`~testbed.models.access_trace.AccessTrace`),
which is what lets the oracle and the what-if take a whole trace set in seconds.
``tests/workloads`` checks these keys against the hashed tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import numpy as np

from testbed.models.access_trace import AccessTrace, hashed_trace, workload_trace
from testbed.workloads.base import WorkloadRequest
from testbed.workloads.block_trace import BlockRequest


def prefix_numbers(blocks: np.ndarray, counts: np.ndarray, roots: np.ndarray) -> np.ndarray:
    """Per block of every request (``blocks``: the requests' ids end to end, ``counts`` per
    request, ``roots``: each request's scope as a negative code), the dense id of the id prefix
    ending there, numbered in order of first appearance: the ids a dict of ``(parent prefix,
    block id)`` pairs hands out walking the requests in order. Computed a prefix length at a
    time: at length ``k + 1`` the prefixes are the distinct (length-``k`` prefix, block id)
    pairs, found by sorting; the working arrays are int32 where the counts allow, so memory
    holds a few 4-byte arrays of the blocks."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    index = np.int32 if total < 2**31 - 1 else np.int64
    starts = (np.cumsum(counts) - counts).astype(index)
    level = np.arange(total, dtype=index) - np.repeat(starts, counts)
    order = np.argsort(level, kind="stable").astype(index)  # by length, then walking order
    bounds = np.searchsorted(level[order], np.arange(int(level.max()) + 2)).tolist()
    del level, starts
    request = np.repeat(np.arange(len(counts), dtype=index), counts)
    classes = np.empty(total, dtype=index)
    first = np.empty(total, dtype=index)  # per class, its first block (walking order)
    num_classes = 0
    for length in range(len(bounds) - 1):
        positions = order[bounds[length] : bounds[length + 1]]
        parents = roots[request[positions]] if length == 0 else classes[positions - 1]
        ids = blocks[positions]
        by_pair = np.lexsort((ids, parents))  # stable: each pair's first block first
        parents, ids, positions = parents[by_pair], ids[by_pair], positions[by_pair]
        new = np.ones(len(positions), dtype=bool)
        new[1:] = (parents[1:] != parents[:-1]) | (ids[1:] != ids[:-1])
        classes[positions] = np.cumsum(new) - 1 + num_classes
        first[num_classes : num_classes + int(new.sum())] = positions[new]
        num_classes += int(new.sum())
    del order, request
    numbers = np.empty(num_classes, dtype=np.int64)
    numbers[np.argsort(first[:num_classes], kind="stable")] = np.arange(num_classes)
    del first
    return numbers[classes]


def _blocks(requests: Sequence[BlockRequest]) -> np.ndarray:
    """The requests' block ids end to end (int32 where they fit)."""
    if not requests:
        return np.zeros(0, dtype=np.int64)
    low = min(int(r.block_ids.min(initial=0)) for r in requests)
    high = max(int(r.block_ids.max(initial=0)) for r in requests)
    small = low >= -(2**31) and high < 2**31
    return np.concatenate(
        [np.asarray(r.block_ids, dtype=np.int32 if small else np.int64) for r in requests]
    )


class BlockKeys:
    """The id prefixes of ``requests`` numbered once; :meth:`at` keys any chunk size."""

    def __init__(self, requests: Sequence[BlockRequest]) -> None:
        roots: dict[int | None, int] = {}
        root_of = np.array(
            [roots.setdefault(r.scope, -1 - len(roots)) for r in requests], dtype=np.int64
        )
        counts = np.array([len(r.block_ids) for r in requests], dtype=np.int64)
        self.prefix_ids = prefix_numbers(_blocks(requests), counts, root_of)
        """Per request and block, the dense id of the id prefix ending at that block."""
        self.block_offsets = np.zeros(len(requests) + 1, dtype=np.int64)
        np.cumsum(counts, out=self.block_offsets[1:])
        self.num_blocks = counts
        self.block_tokens = np.array([r.block_tokens for r in requests], dtype=np.int64)
        self.prompt_tokens = np.array([r.num_prompt_tokens for r in requests], dtype=np.int64)
        self.arrival_s = np.array([r.arrival_s for r in requests], dtype=np.float64)
        self.groups = np.array([r.group for r in requests], dtype=object)

    def at(self, chunk_size: int) -> AccessTrace:
        """The oracle's access trace of the requests at ``chunk_size``: each request's complete
        chunks, keyed (module docstring)."""
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        counts = self.prompt_tokens // chunk_size
        offsets = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        request = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
        end_token = (np.arange(offsets[-1], dtype=np.int64) - offsets[request] + 1) * chunk_size
        size = self.block_tokens[request]
        block = (end_token - 1) // size
        within = end_token - block * size  # 1..size
        named = block < self.num_blocks[request]
        prefix = self.prefix_ids[self.block_offsets[request[named]] + block[named]]
        codes = prefix * (int(self.block_tokens.max(initial=1)) + 1) + within[named]
        unique, dense = np.unique(codes, return_inverse=True)
        keys = np.empty(len(request), dtype=np.int64)
        keys[named] = dense.reshape(-1)
        own = int((~named).sum())  # chunks reaching into a tail: keys no other chunk has
        keys[~named] = np.arange(len(unique), len(unique) + own, dtype=np.int64)
        return workload_trace(
            chunk_size,
            keys,
            offsets,
            num_keys=len(unique) + own,
            prompt_tokens=self.prompt_tokens,
            arrival_s=self.arrival_s,
            groups=self.groups,
        )


def block_key_trace(requests: Sequence[BlockRequest], chunk_size: int) -> AccessTrace:
    """Block-hash trace requests keyed from their block ids, no token synthesised: the
    keys their synthesised tokens' chunk hashes would give, up to renaming."""
    return BlockKeys(requests).at(chunk_size)


def key_trace(
    requests: Sequence[WorkloadRequest] | Sequence[BlockRequest], chunk_size: int
) -> AccessTrace:
    """:func:`block_key_trace` for block requests, :func:`hashed_trace` (hashing their
    tokens) otherwise."""
    if requests and isinstance(requests[0], BlockRequest):
        return block_key_trace(cast(Sequence[BlockRequest], requests), chunk_size)
    return hashed_trace(cast(Sequence[WorkloadRequest], requests), chunk_size)
