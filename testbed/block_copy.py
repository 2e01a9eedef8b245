"""Batched copies of paged KV blocks into and out of pool objects, in numpy (no torch).

The copy engine of both transfer modes: the worker copies between its own KV and the pool
(``connector.kv_copy``), or the server copies between the engine's KV, mapped from shared
memory, and its pool (``server.kv_copier``). Both build a :class:`BlockCopier` over the same
:class:`~testbed.kv_layout.PagedLayout`, so they write and read identical objects (layout:
``testbed.kv_layout``).

How it copies. A layer's block is cut into *runs*: the largest trailing group of dimensions
that is contiguous in memory and whose size divides every other stride and offset. The KV is
then one flat array of runs per buffer, a chunk is an array of run indices, and a chunk is
copied, all layers of a buffer at once, by one ``numpy.take`` (store: gather into the object)
or one fancy assignment (retrieve: scatter out of it): one call per chunk for vLLM's single
allocation (one for a whole batch whose slots lie back to back in the pool, as a batch the
server allocates in one go does), one per chunk and layer for separate layer tensors. On
vLLM's layouts a run is a whole block of one layer (``block_size × heads × 2·head_dim``
elements: 64–128 KiB for Llama-3-8B), so each call is a loop of large ``memcpy`` in C with
the GIL released. The run indices of a whole operation are computed in a few numpy calls
(plain Python for small operations), not per block or layer.

Threads. numpy runs each call on the calling thread, whatever ``torch.set_num_threads`` says:
the copies never change, nor depend on, the process-wide intra-op pool that vLLM's forward pass
uses. One thread is the default (on a 2-core machine a second one gains nothing and a busy
neighbour makes it straggle, see ``testbed.bench.copies``); ``num_threads > 1`` splits each
call by layers over a small pool of this copier's own.

Contract: ``gather`` writes every byte of each object from the blocks named; ``scatter``
writes each named block except the first ``skip_blocks`` of a chunk, which are never
touched. Block ids and slot bounds are checked before any byte moves; nothing is clipped.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np

from testbed.kv_layout import PagedLayout


class SlotLike(Protocol):
    """Where an object lives in the pool (``testbed.protocol.Slot`` is one)."""

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


def item_copies(
    block_ids: Sequence[int],
    slots: Sequence[SlotLike | None],
    blocks_per_chunk: int,
    skip_blocks: int = 0,
) -> tuple[list[ChunkCopy], list[int]]:
    """One protocol item's chunks: a copy per chunk with a slot (``block_ids`` cut into
    chunks of ``blocks_per_chunk``; a retrieve never writes the item's first ``skip_blocks``),
    and the blocks of the chunks without one (minus the skipped ones), which must be
    recomputed."""
    copies: list[ChunkCopy] = []
    missing: list[int] = []
    for index, slot in enumerate(slots):
        blocks = block_ids[index * blocks_per_chunk : (index + 1) * blocks_per_chunk]
        skip = min(max(0, skip_blocks - index * blocks_per_chunk), len(blocks))
        if slot is None:
            missing += blocks[skip:]
        else:
            copies.append(ChunkCopy(slot, blocks, skip))
    return copies, missing


_SMALL = 256
"""Run indices in an operation up to which plain Python computes them faster than numpy
(numpy's fixed cost per call dominates small operations, all the more with cold caches)."""

_Copy = Callable[[np.ndarray, np.ndarray, np.ndarray], None]
_Work = tuple[_Copy, np.ndarray, np.ndarray, np.ndarray]
"""One copy: ``op(runs, index, obj)`` with ``op`` one of ``_take`` and ``_put``."""


@dataclass(frozen=True)
class _Segment:
    """Consecutive layers that live in one buffer at run-aligned offsets."""

    runs: np.ndarray  # the buffer as a 1-d array of runs (void items of ``run_bytes``)
    base_index: np.ndarray  # (layers, *outer, 1, *mid): run index of each piece of block 0
    first_layer: int
    num_layers: int
    rows: list[list[int]]  # base_index as lists: per (layer, *outer), over *mid


class BlockCopier:
    """Copies blocks of the paged KV described by ``layout`` to and from pool objects.

    ``buffers[l]`` is the writable 1-d uint8 array that layer ``l``'s offset refers to (layers
    may share one). The arrays stay referenced for the copier's life.
    """

    def __init__(
        self, layout: PagedLayout, buffers: Sequence[np.ndarray], *, num_threads: int = 1
    ) -> None:
        if len(buffers) != layout.num_layers:
            raise ValueError(f"{len(buffers)} buffers for {layout.num_layers} layers")
        if num_threads < 1:
            raise ValueError(f"num_threads must be at least 1, got {num_threads}")
        for offset, buffer in zip(layout.layer_offsets_bytes, buffers, strict=True):
            _check_buffer(buffer)
            if offset + layout.layer_extent_bytes() > buffer.nbytes:
                raise ValueError(
                    f"a layer at byte {offset} reaches past its {buffer.nbytes}-byte buffer"
                )
        self.layout = layout
        d = layout.block_dim
        self._run_dim, self.run_bytes = _choose_run(layout, buffers)
        self._block_stride_runs = layout.strides_bytes[d] // self.run_bytes
        self._run_dtype = np.dtype((np.void, self.run_bytes))
        self._num_layers = layout.num_layers
        self._num_blocks = layout.num_blocks
        self._object_block_bytes = layout.layer_block_bytes * layout.num_layers
        self._segments = _segments(layout, buffers, self._run_dim, self.run_bytes)
        self._pool = ThreadPoolExecutor(num_threads) if num_threads > 1 else None
        self.num_threads = num_threads

    # -----------------------------------------------------------------------------------------
    # Public
    # -----------------------------------------------------------------------------------------

    def gather(self, pool: np.ndarray, copies: Sequence[ChunkCopy]) -> int:
        """Copies each chunk's blocks into its slot of ``pool``; returns the bytes written."""
        _check_buffer(pool)
        whole = self._back_to_back(pool, copies, _take)
        if whole is not None:
            self._run([whole])
            return sum(copy.slot.nbytes for copy in copies)
        work: list[_Work] = []
        written = 0
        for copy, indices in zip(copies, self._indices(copies, skip=False), strict=True):
            if copy.skip_blocks:
                raise ValueError("a store copies whole chunks; skip_blocks must be 0")
            obj = self._object(pool, copy.slot, len(copy.block_ids))
            per_layer = obj.size // self._num_layers
            for segment, index in zip(self._segments, indices, strict=True):
                start = segment.first_layer * per_layer
                target = obj[start : start + segment.num_layers * per_layer]
                work.append((_take, segment.runs, index, target))
            written += copy.slot.nbytes
        self._run(work)
        return written

    def scatter(self, pool: np.ndarray, copies: Sequence[ChunkCopy]) -> int:
        """Copies each slot of ``pool`` into its chunk's blocks, except the first
        ``skip_blocks`` of each chunk; returns the bytes written into the KV."""
        _check_buffer(pool)
        whole = self._back_to_back(pool, copies, _put)
        if whole is not None:
            self._run([whole])
            return sum(copy.slot.nbytes for copy in copies)
        work: list[_Work] = []
        written = 0
        for copy in copies:
            if not 0 <= copy.skip_blocks <= len(copy.block_ids):
                raise ValueError(
                    f"skip_blocks {copy.skip_blocks} outside a chunk of {len(copy.block_ids)} "
                    "blocks"
                )
        for copy, indices in zip(copies, self._indices(copies, skip=True), strict=True):
            n, skip = len(copy.block_ids), copy.skip_blocks
            obj = self._object(pool, copy.slot, n)
            if skip == n:
                continue
            shaped = obj.reshape(self._num_layers, *self._run_shape(n))
            kept = self._block_axis_slice(skip)
            for segment, index in zip(self._segments, indices, strict=True):
                source = shaped[segment.first_layer : segment.first_layer + segment.num_layers]
                work.append((_put, segment.runs, index, source[kept]))
            written += (n - skip) * self._object_block_bytes
        self._run(work)
        return written

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    # -----------------------------------------------------------------------------------------
    # Internal
    # -----------------------------------------------------------------------------------------

    def _back_to_back(
        self, pool: np.ndarray, copies: Sequence[ChunkCopy], op: _Copy
    ) -> _Work | None:
        """The whole operation as one call, where it can be: all layers in one buffer,
        chunks of one length, none skipping blocks, slots back to back in the pool (a batch
        the server allocated in one go). None otherwise, or if anything fails a check (the
        general path then says what)."""
        if len(copies) < 2 or len(self._segments) != 1:
            return None
        n = len(copies[0].block_ids)
        start = end = copies[0].slot.offset
        for copy in copies:
            slot = copy.slot
            if copy.skip_blocks or len(copy.block_ids) != n or slot.offset != end:
                return None
            if slot.nbytes != n * self._object_block_bytes:
                return None
            end += slot.nbytes
        if n == 0 or start < 0 or end > pool.nbytes:
            return None
        ids = np.asarray([copy.block_ids for copy in copies], dtype=np.intp)
        if int(ids.min()) < 0 or int(ids.max()) >= self._num_blocks:
            return None
        shape = [len(ids)] + [1] * (self._run_dim + 1)
        shape[2 + self.layout.block_dim] = n
        segment = self._segments[0]
        index = segment.base_index + (ids * self._block_stride_runs).reshape(shape)
        region = pool[start:end].view(self._run_dtype)
        return (op, segment.runs, index, region if op is _take else region.reshape(index.shape))

    def _indices(self, copies: Sequence[ChunkCopy], skip: bool) -> list[list[np.ndarray]]:
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
        if lowest < 0 or highest >= self._num_blocks:
            raise ValueError(f"block ids {lowest}..{highest} outside 0..{self._num_blocks - 1}")
        pieces = sum(len(segment.rows) * len(segment.rows[0]) for segment in self._segments)
        if sum(len(copy.block_ids) for copy in copies) * pieces <= _SMALL:
            return [self._chunk_indices(copy, skip) for copy in copies]
        if len(lengths) == 1:
            groups = [(np.asarray([c.block_ids for c in copies], dtype=np.intp), copies)]
        else:
            groups = [(np.asarray([c.block_ids], dtype=np.intp), [c]) for c in copies]
        indices: list[list[np.ndarray]] = []
        for ids, members in groups:
            shape = [len(ids)] + [1] * (self._run_dim + 1)
            shape[2 + self.layout.block_dim] = ids.shape[1]
            offsets = (ids * self._block_stride_runs).reshape(shape)
            per_segment = [segment.base_index + offsets for segment in self._segments]
            for number, copy in enumerate(members):
                kept = self._block_axis_slice(copy.skip_blocks if skip else 0)
                indices.append([index[number][kept] for index in per_segment])
        return indices

    def _chunk_indices(self, copy: ChunkCopy, skip: bool) -> list[np.ndarray]:
        first = copy.skip_blocks if skip else 0
        scaled = [block * self._block_stride_runs for block in copy.block_ids[first:]]
        indices = []
        for segment in self._segments:
            flat = [x + block for row in segment.rows for block in scaled for x in row]
            shape = list(segment.base_index.shape)
            shape[1 + self.layout.block_dim] = len(scaled)
            indices.append(np.array(flat, dtype=np.intp).reshape(shape))
        return indices

    def _object(self, pool: np.ndarray, slot: SlotLike, num_blocks: int) -> np.ndarray:
        """The slot as a flat array of runs, checked to hold ``num_blocks`` blocks."""
        offset, nbytes = slot.offset, slot.nbytes
        if nbytes != num_blocks * self._object_block_bytes:
            raise ValueError(
                f"slot of {nbytes} bytes does not hold {num_blocks} blocks of "
                f"{self._num_layers} layers ({num_blocks * self._object_block_bytes} bytes)"
            )
        if offset < 0 or offset + nbytes > pool.nbytes:
            raise ValueError(f"slot {offset}+{nbytes} outside a {pool.nbytes}-byte pool")
        return pool[offset : offset + nbytes].view(self._run_dtype)

    def _run_shape(self, num_blocks: int) -> list[int]:
        """Shape of one layer of an object, counted in runs."""
        shape = list(self.layout.shape[: self._run_dim])
        shape[self.layout.block_dim] = num_blocks
        return shape

    def _block_axis_slice(self, skip: int) -> tuple[slice, ...]:
        """Index of a chunk's blocks from ``skip`` on, in an array of the object's shape."""
        return (slice(None),) * (1 + self.layout.block_dim) + (slice(skip, None),)

    def _run(self, work: list[_Work]) -> None:
        """Runs the copies, all checked already: here, or split by layers over the pool."""
        if self._pool is None:
            for op, runs, index, obj in work:
                op(runs, index, obj)
            return
        futures = []
        for op, runs, index, obj in work:
            rows = len(index)
            per_row = len(obj) // rows if op is _take else 1
            parts = min(self.num_threads, rows)
            bounds = [rows * k // parts for k in range(parts + 1)]
            for lo, hi in itertools.pairwise(bounds):
                part = obj[lo * per_row : hi * per_row] if op is _take else obj[lo:hi]
                futures.append(self._pool.submit(op, runs, index[lo:hi], part))
        for future in futures:
            future.result()


def _take(runs: np.ndarray, index: np.ndarray, obj: np.ndarray) -> None:
    # mode="clip" (ids are checked beforehand): with the default "raise", numpy stages the
    # whole output in a temporary and copies it again. ``obj`` is a 1-d contiguous view.
    np.take(runs, index.reshape(-1), out=obj, mode="clip")


def _put(runs: np.ndarray, index: np.ndarray, obj: np.ndarray) -> None:
    runs[index] = obj


def _check_buffer(buffer: np.ndarray) -> None:
    if buffer.dtype != np.uint8 or buffer.ndim != 1 or not buffer.flags.c_contiguous:
        raise ValueError("a KV or pool buffer must be a contiguous 1-d uint8 array")
    if not buffer.flags.writeable:
        raise ValueError("a KV or pool buffer must be writable")


def _run_dtype(run_bytes: int) -> np.dtype:
    return np.dtype((np.void, run_bytes))


def _choose_run(layout: PagedLayout, buffers: Sequence[np.ndarray]) -> tuple[int, int]:
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
        offsets_ok = _offsets_aligned(layout, buffers, run)
        if dense and offsets_ok and all(stride % run == 0 for stride in coarse):
            return k, run
    raise AssertionError("unreachable: one element is always a run")


def _offsets_aligned(layout: PagedLayout, buffers: Sequence[np.ndarray], run: int) -> bool:
    """Whether layers sharing a buffer sit a whole number of runs apart."""
    first: dict[int, int] = {}
    for offset, buffer in zip(layout.layer_offsets_bytes, buffers, strict=True):
        base = first.setdefault(id(buffer), offset)
        if (offset - base) % run:
            return False
    return True


def _segments(
    layout: PagedLayout, buffers: Sequence[np.ndarray], run_dim: int, run_bytes: int
) -> list[_Segment]:
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
    groups: list[list[int]] = []
    for layer in range(layout.num_layers):
        if groups and buffers[groups[-1][0]] is buffers[layer]:
            groups[-1].append(layer)
        else:
            groups.append([layer])
    segments = []
    for layers in groups:
        buffer = buffers[layers[0]]
        offsets = [layout.layer_offsets_bytes[layer] for layer in layers]
        base = min(offsets)
        end = max(offsets) + layout.layer_extent_bytes()
        num_runs = (end - base) // run_bytes  # exact: the last piece ends a run
        runs = buffer[base : base + num_runs * run_bytes].view(_run_dtype(run_bytes))
        base_index = np.stack(
            [(piece_bytes + offset - base) // run_bytes for offset in offsets]
        ).astype(np.intp)
        rows = base_index.reshape(math.prod(base_index.shape[:run_dim_lead]), -1).tolist()
        segments.append(_Segment(runs, base_index, layers[0], len(layers), rows))
    return segments
