"""Batched copies of paged KV blocks into and out of pool objects, in numpy (no torch).

The copy engine of both transfer modes: the worker copies between its own KV and the pool
(``connector.kv_copy``), or the server copies between the engine's KV, mapped from shared
memory, and its pool (``server.kv_copier``). Both build a :class:`BlockCopier` over the same
:class:`~testbed.core.kv_layout.PagedLayout`, so they write and read identical objects (layout:
``testbed.core.kv_layout``).

How it copies. A layer's block is cut into *runs* (``testbed.core.block_runs``, whose index math
the torch engine for CUDA KV, ``testbed.core.torch_block_copy``, shares). The KV is then one flat
array of runs per buffer, a chunk is an array of run indices, and a chunk is copied, all
layers of a buffer at once, by one ``numpy.take`` (store: gather into the object) or one fancy
assignment (retrieve: scatter out of it): one call per chunk for vLLM's single
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
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from testbed.core.block_runs import ChunkCopy, RunGeometry, SlotLike
from testbed.core.kv_layout import PagedLayout

__all__ = ["BlockCopier", "ChunkCopy", "SlotLike", "item_copies"]


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


_Copy = Callable[[np.ndarray, np.ndarray, np.ndarray], None]
_Work = tuple[_Copy, np.ndarray, np.ndarray, np.ndarray]
"""One copy: ``op(runs, index, obj)`` with ``op`` one of ``_take`` and ``_put``."""


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
        self.geometry = RunGeometry(layout, [id(buffer) for buffer in buffers])
        self.run_bytes = self.geometry.run_bytes
        self._run_dtype = np.dtype((np.void, self.run_bytes))
        self._num_layers = layout.num_layers
        distinct = list({id(buffer): buffer for buffer in buffers}.values())
        self._runs = [
            distinct[segment.buffer][
                segment.base_bytes : segment.base_bytes + segment.num_runs * self.run_bytes
            ].view(self._run_dtype)
            for segment in self.geometry.segments
        ]
        self._pool = ThreadPoolExecutor(num_threads) if num_threads > 1 else None
        self.num_threads = num_threads

    # -----------------------------------------------------------------------------------------
    # Public
    # -----------------------------------------------------------------------------------------

    def gather(self, pool: np.ndarray, copies: Sequence[ChunkCopy]) -> int:
        """Copies each chunk's blocks into its slot of ``pool``; returns the bytes written."""
        return self._copy(pool, copies, _take)

    def scatter(self, pool: np.ndarray, copies: Sequence[ChunkCopy]) -> int:
        """Copies each slot of ``pool`` into its chunk's blocks, except the first
        ``skip_blocks`` of each chunk; returns the bytes written into the KV."""
        return self._copy(pool, copies, _put)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    # -----------------------------------------------------------------------------------------
    # Internal
    # -----------------------------------------------------------------------------------------

    def _copy(self, pool: np.ndarray, copies: Sequence[ChunkCopy], op: _Copy) -> int:
        """Copies in the direction of ``op`` (``_take``: blocks into slots; ``_put``: slots into
        blocks): as one call where the slots lie back to back, else chunk by chunk."""
        _check_buffer(pool)
        whole = self._back_to_back(pool, copies, op)
        if whole is not None:
            self._run([whole])
            return sum(copy.slot.nbytes for copy in copies)
        work: list[_Work] = []
        if op is _take:
            written = self._gather_work(pool, copies, work)
        else:
            written = self._scatter_work(pool, copies, work)
        self._run(work)
        return written

    def _gather_work(self, pool: np.ndarray, copies: Sequence[ChunkCopy], work: list[_Work]) -> int:
        """Appends the copies of each chunk's blocks into its slot; the bytes they write."""
        written = 0
        for copy, indices in zip(copies, self.geometry.indices(copies, skip=False), strict=True):
            if copy.skip_blocks:
                raise ValueError("a store copies whole chunks; skip_blocks must be 0")
            obj = self._object(pool, copy.slot, len(copy.block_ids))
            per_layer = obj.size // self._num_layers
            for segment, runs, index in zip(
                self.geometry.segments, self._runs, indices, strict=True
            ):
                start = segment.first_layer * per_layer
                target = obj[start : start + segment.num_layers * per_layer]
                work.append((_take, runs, index, target))
            written += copy.slot.nbytes
        return written

    def _scatter_work(
        self, pool: np.ndarray, copies: Sequence[ChunkCopy], work: list[_Work]
    ) -> int:
        """Appends the copies of each slot into its chunk's blocks but the skipped ones; the
        bytes they write."""
        written = 0
        for copy in copies:
            if not 0 <= copy.skip_blocks <= len(copy.block_ids):
                raise ValueError(
                    f"skip_blocks {copy.skip_blocks} outside a chunk of {len(copy.block_ids)} "
                    "blocks"
                )
        geometry = self.geometry
        for copy, indices in zip(copies, geometry.indices(copies, skip=True), strict=True):
            n, skip = len(copy.block_ids), copy.skip_blocks
            obj = self._object(pool, copy.slot, n)
            if skip == n:
                continue
            shaped = obj.reshape(self._num_layers, *geometry.run_shape(n))
            kept = geometry.block_axis_slice(skip)
            for segment, runs, index in zip(geometry.segments, self._runs, indices, strict=True):
                source = shaped[segment.first_layer : segment.first_layer + segment.num_layers]
                work.append((_put, runs, index, source[kept]))
            written += (n - skip) * geometry.object_block_bytes
        return written

    def _back_to_back(
        self, pool: np.ndarray, copies: Sequence[ChunkCopy], op: _Copy
    ) -> _Work | None:
        """The whole operation as one call, where :meth:`RunGeometry.back_to_back` allows."""
        index = self.geometry.back_to_back(copies, pool.nbytes)
        if index is None:
            return None
        start = copies[0].slot.offset
        end = start + sum(copy.slot.nbytes for copy in copies)
        region = pool[start:end].view(self._run_dtype)
        return (op, self._runs[0], index, region if op is _take else region.reshape(index.shape))

    def _object(self, pool: np.ndarray, slot: SlotLike, num_blocks: int) -> np.ndarray:
        """The slot as a flat array of runs, checked to hold ``num_blocks`` blocks."""
        self.geometry.check_slot(slot, num_blocks, pool.nbytes)
        return pool[slot.offset : slot.offset + slot.nbytes].view(self._run_dtype)

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
