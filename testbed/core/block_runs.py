"""Where the bytes of paged KV blocks are, counted in *runs*: the index math of every copy engine.

Pure numpy over a :class:`~testbed.core.kv_layout.PagedLayout` and the identity of the buffers the
layers live in; no buffer is touched. Both copy engines build on it: the numpy one
(``testbed.core.block_copy``, CPU KV and shared memory) and the torch one
(``testbed.core.torch_block_copy``, CUDA KV mapped through CUDA IPC), so they agree on every
object's bytes by construction.

A layer's block is cut into *runs*: the largest trailing group of dimensions that is contiguous
in memory and whose size divides every other stride and offset. The KV is then one flat array
of runs per buffer, and a chunk is an array of run indices in the pool object's order
(``testbed.core.kv_layout``: per layer, that layer's blocks as ``index_select(block_dim, ids)``).
Consecutive layers in one buffer form a *segment*: one index array covers all of them.

Contract: :meth:`RunGeometry.indices` checks every block id before returning; the indices of a
copy with ``skip`` leave out the chunk's first ``skip_blocks`` blocks.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np

from testbed.core.kv_layout import PagedLayout

SMALL_OPERATION_RUNS = 256
"""Run indices in an operation up to which plain Python computes them faster than numpy
(numpy's fixed cost per call dominates small operations, all the more with cold caches)."""


class SlotLike(Protocol):
    """Where an object lives in the pool (``testbed.core.protocol.Slot`` is one)."""

    @property
    def offset(self) -> int: ...

    @property
    def nbytes(self) -> int: ...


class ChunkCopy(NamedTuple):
    """One chunk of an operation: its pool slot and, in order, its KV blocks."""

    slot: SlotLike
    block_ids: Sequence[int]
    skip_blocks: int = 0
    """Retrieve only: leading blocks left untouched (vLLM's own prefix cache holds them)."""


@dataclass(frozen=True)
class Segment:
    """Consecutive layers that live in one buffer at run-aligned offsets."""

    first_layer: int
    num_layers: int
    buffer: int
    """Which distinct buffer (in order of first appearance over the layers)."""
    base_bytes: int
    """Byte offset in that buffer of the segment's run 0."""
    num_runs: int
    """Runs from ``base_bytes`` to the end of the segment's last layer."""
    base_index: np.ndarray
    """``(layers, *outer, 1, *mid)``: the run index of each piece of block 0."""
    rows: list[list[int]]
    """``base_index`` as lists: per (layer, *outer), over *mid."""


class RunGeometry:
    """The runs of the paged KV ``layout`` whose layer ``l`` lives in the buffer named
    ``buffer_keys[l]`` (layers with equal keys share a buffer)."""

    def __init__(self, layout: PagedLayout, buffer_keys: Sequence[Hashable]) -> None:
        if len(buffer_keys) != layout.num_layers:
            raise ValueError(f"{len(buffer_keys)} buffers for {layout.num_layers} layers")
        self.layout = layout
        self.run_dim, self.run_bytes = _choose_run(layout, buffer_keys)
        self.block_stride_runs = layout.strides_bytes[layout.block_dim] // self.run_bytes
        self.object_block_bytes = layout.layer_block_bytes * layout.num_layers
        self.segments = _segments(layout, buffer_keys, self.run_dim, self.run_bytes)

    @property
    def num_layers(self) -> int:
        return self.layout.num_layers

    def check_copies(self, copies: Sequence[ChunkCopy], pool_bytes: int, store: bool) -> None:
        """Raises ``ValueError`` unless every copy's blocks, skip and slot fit (before any
        byte moves: on a device a bad index is an asynchronous assert, not an exception)."""
        num_blocks = self.layout.num_blocks
        for copy in copies:
            n, slot = len(copy.block_ids), copy.slot
            if not n or min(copy.block_ids) < 0 or max(copy.block_ids) >= num_blocks:
                raise ValueError(f"block ids {list(copy.block_ids)} outside 0..{num_blocks - 1}")
            self.check_slot(slot, n, pool_bytes)
            if store and copy.skip_blocks:
                raise ValueError("a store copies whole chunks; skip_blocks must be 0")
            if not 0 <= copy.skip_blocks <= n:
                raise ValueError(f"skip_blocks {copy.skip_blocks} outside a chunk of {n} blocks")

    def check_slot(self, slot: SlotLike, num_blocks: int, pool_bytes: int) -> None:
        offset, nbytes = slot.offset, slot.nbytes
        if nbytes != num_blocks * self.object_block_bytes:
            raise ValueError(
                f"slot of {nbytes} bytes does not hold {num_blocks} blocks of "
                f"{self.num_layers} layers ({num_blocks * self.object_block_bytes} bytes)"
            )
        if offset < 0 or offset + nbytes > pool_bytes:
            raise ValueError(f"slot {offset}+{nbytes} outside a {pool_bytes}-byte pool")

    def back_to_back(self, copies: Sequence[ChunkCopy], pool_bytes: int) -> np.ndarray | None:
        """The run indices of a whole operation in one array, shaped like its objects laid
        end to end, where that is possible: all layers in one buffer, chunks of one length,
        none skipping blocks, slots back to back in the pool (a batch the server allocated in
        one go). None otherwise, or if anything fails a check (the general path says what)."""
        if len(copies) < 2 or len(self.segments) != 1:
            return None
        n = len(copies[0].block_ids)
        start = end = copies[0].slot.offset
        for copy in copies:
            slot = copy.slot
            if copy.skip_blocks or len(copy.block_ids) != n or slot.offset != end:
                return None
            if slot.nbytes != n * self.object_block_bytes:
                return None
            end += slot.nbytes
        if n == 0 or start < 0 or end > pool_bytes:
            return None
        ids = np.asarray([copy.block_ids for copy in copies], dtype=np.intp)
        if int(ids.min()) < 0 or int(ids.max()) >= self.layout.num_blocks:
            return None
        return self.segments[0].base_index + self._block_offsets(ids)

    def indices(self, copies: Sequence[ChunkCopy], skip: bool) -> list[list[np.ndarray]]:
        """Per copy and segment, the run indices of the blocks to copy (from ``skip_blocks``
        on if ``skip``), shaped like that part of the segment's object; every block id
        checked. Small operations are computed in plain Python, larger ones in a few numpy
        calls for the whole operation (chunks of one length, the usual case, together)."""
        if not copies:
            return []
        lengths = {len(copy.block_ids) for copy in copies}
        if 0 in lengths:
            raise ValueError("a chunk needs a non-empty list of block ids")
        lowest = min(min(copy.block_ids) for copy in copies)
        highest = max(max(copy.block_ids) for copy in copies)
        num_blocks = self.layout.num_blocks
        if lowest < 0 or highest >= num_blocks:
            raise ValueError(f"block ids {lowest}..{highest} outside 0..{num_blocks - 1}")
        pieces = sum(len(segment.rows) * len(segment.rows[0]) for segment in self.segments)
        if sum(len(copy.block_ids) for copy in copies) * pieces <= SMALL_OPERATION_RUNS:
            return [self._chunk_indices(copy, skip) for copy in copies]
        if len(lengths) == 1:
            groups = [(np.asarray([c.block_ids for c in copies], dtype=np.intp), copies)]
        else:
            groups = [(np.asarray([c.block_ids], dtype=np.intp), [c]) for c in copies]
        indices: list[list[np.ndarray]] = []
        for ids, members in groups:
            offsets = self._block_offsets(ids)
            per_segment = [segment.base_index + offsets for segment in self.segments]
            for number, copy in enumerate(members):
                kept = self.block_axis_slice(copy.skip_blocks if skip else 0)
                indices.append([index[number][kept] for index in per_segment])
        return indices

    def run_shape(self, num_blocks: int) -> list[int]:
        """Shape of one layer of an object, counted in runs."""
        shape = list(self.layout.shape[: self.run_dim])
        shape[self.layout.block_dim] = num_blocks
        return shape

    def block_axis_slice(self, skip: int) -> tuple[slice, ...]:
        """Index of a chunk's blocks from ``skip`` on, in an array of the object's shape
        (layers first)."""
        return (slice(None),) * (1 + self.layout.block_dim) + (slice(skip, None),)

    def _block_offsets(self, ids: np.ndarray) -> np.ndarray:
        """``ids`` (chunks × blocks) as run offsets, shaped to add to a ``base_index``."""
        shape = [len(ids)] + [1] * (self.run_dim + 1)
        shape[2 + self.layout.block_dim] = ids.shape[1]
        return (ids * self.block_stride_runs).reshape(shape)

    def _chunk_indices(self, copy: ChunkCopy, skip: bool) -> list[np.ndarray]:
        first = copy.skip_blocks if skip else 0
        scaled = [block * self.block_stride_runs for block in copy.block_ids[first:]]
        indices = []
        for segment in self.segments:
            flat = [x + block for row in segment.rows for block in scaled for x in row]
            shape = list(segment.base_index.shape)
            shape[1 + self.layout.block_dim] = len(scaled)
            indices.append(np.array(flat, dtype=np.intp).reshape(shape))
        return indices


def _choose_run(layout: PagedLayout, buffer_keys: Sequence[Hashable]) -> tuple[int, int]:
    """``(k, bytes)``: dimensions ``k…`` form one contiguous run of ``bytes``; every coarser
    stride and every layer's offset within its buffer is a multiple of it."""
    shape, strides = layout.shape, layout.strides_bytes
    for k in range(layout.block_dim + 1, len(shape) + 1):
        run = math.prod(shape[k:]) * layout.itemsize
        dense = all(
            size == 1 or stride == math.prod(shape[i + 1 :]) * layout.itemsize
            for i, (size, stride) in enumerate(zip(shape, strides, strict=True))
            if i >= k
        )
        coarse = [stride for size, stride in zip(shape[:k], strides[:k], strict=True) if size > 1]
        offsets_ok = _offsets_aligned(layout, buffer_keys, run)
        if dense and offsets_ok and all(stride % run == 0 for stride in coarse):
            return k, run
    raise AssertionError("unreachable: one element is always a run")


def _offsets_aligned(layout: PagedLayout, buffer_keys: Sequence[Hashable], run: int) -> bool:
    """Whether layers sharing a buffer sit a whole number of runs apart."""
    first: dict[Hashable, int] = {}
    for offset, key in zip(layout.layer_offsets_bytes, buffer_keys, strict=True):
        base = first.setdefault(key, offset)
        if (offset - base) % run:
            return False
    return True


def _segments(
    layout: PagedLayout, buffer_keys: Sequence[Hashable], run_dim: int, run_bytes: int
) -> list[Segment]:
    """Maximal runs of consecutive layers sharing a buffer, each with its run indices."""
    shape, strides = layout.shape, layout.strides_bytes
    coarse_shape = list(shape[:run_dim])
    coarse_shape[layout.block_dim] = 1
    grid = sum(
        (np.arange(size).reshape([-1 if i == j else 1 for j in range(run_dim)]) * stride)
        for i, (size, stride) in enumerate(zip(coarse_shape, strides[:run_dim], strict=True))
    )
    piece_bytes = np.broadcast_to(np.asarray(grid, dtype=np.intp), coarse_shape)
    run_dim_lead = 1 + layout.block_dim  # base_index axes before the block axis
    numbers: dict[Hashable, int] = {}
    groups: list[list[int]] = []
    for layer in range(layout.num_layers):
        numbers.setdefault(buffer_keys[layer], len(numbers))
        if groups and buffer_keys[groups[-1][0]] == buffer_keys[layer]:
            groups[-1].append(layer)
        else:
            groups.append([layer])
    segments = []
    for layers in groups:
        offsets = [layout.layer_offsets_bytes[layer] for layer in layers]
        base = min(offsets)
        end = max(offsets) + layout.layer_extent_bytes()
        base_index = np.stack(
            [(piece_bytes + offset - base) // run_bytes for offset in offsets]
        ).astype(np.intp)
        rows = base_index.reshape(math.prod(base_index.shape[:run_dim_lead]), -1).tolist()
        segments.append(
            Segment(
                first_layer=layers[0],
                num_layers=len(layers),
                buffer=numbers[buffer_keys[layers[0]]],
                base_bytes=base,
                num_runs=(end - base) // run_bytes,  # exact: the last piece ends a run
                base_index=base_index,
                rows=rows,
            )
        )
    return segments
