"""Batched copies of paged KV blocks held in torch tensors, on any device, to and from a pool.

The copy engine for CUDA KV: the cache server's copies from KV it maps through CUDA IPC
(``server.cuda_engine``) and the worker's own copies of CUDA KV (``connector.kv_copy``). It
uses the run index math of ``testbed.core.block_runs``, as the numpy engine does, so both write and
read the same pool objects (``testbed.core.kv_layout``). Written with device-agnostic torch calls:
the same code runs on CPU tensors, which is how it is tested on machines without a GPU.

How it copies one operation (``ChunkCopy`` per chunk):

- slots lying back to back in the pool form a *group* (a batch the server allocates in one go
  is one group); each group is copied as one region of the pool;
- the KV is viewed per buffer as a 2-d tensor of runs ``(num_runs, run_bytes / w)`` of the
  widest element ``w`` (16, 8, 4, 2 or 1 bytes) that the run size and every address allow, so a
  kernel moves 16 bytes per load where it can;
- store: one ``index_select`` per group and buffer segment gathers the runs in object order,
  straight into the pool region when pool and KV share a device (GPU pool), else into a
  staging tensor on the KV's device, followed by one copy of the whole region to the pool
  (pinned host memory: one DMA transfer per group);
- retrieve: the mirror image, one copy of the region to the KV's device (if the pool is
  elsewhere) and one ``index_copy_`` per group and segment; a chunk's first ``skip_blocks``
  blocks are never written.

vLLM's one-allocation layouts are one segment: a whole group is then one kernel and one copy,
never one copy per block or layer. Separate layer tensors cost one kernel per layer per group.

Ordering is the caller's: the copies are issued on the current stream (``torch.cuda.stream``),
asynchronous where the memory allows (``non_blocking``). Contract as ``testbed.core.block_copy``:
every id, skip and slot is checked before any byte moves (on a device a bad index would be an
asynchronous assert, not an exception).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from testbed.core.block_runs import ChunkCopy, RunGeometry, Segment
from testbed.core.kv_layout import PagedLayout

ELEMENT_TYPES: dict[int, torch.dtype] = {
    16: torch.complex128,
    8: torch.int64,
    4: torch.int32,
    2: torch.int16,
    1: torch.uint8,
}
"""Element types the copies move runs as, by width in bytes (bits are copied, never computed
on: a complex128 NaN pattern loads and stores unchanged)."""


class TorchBlockCopier:
    """Copies blocks of the paged KV ``layout`` between ``buffers`` and pool tensors.

    ``buffers[l]`` is the 1-d uint8 tensor that layer ``l``'s offset refers to (layers may share
    one); all on one device. ``max_width`` caps the element width (benchmarks compare widths);
    ``non_blocking`` makes copies between host and device asynchronous (pinned pools).
    """

    def __init__(
        self,
        layout: PagedLayout,
        buffers: Sequence[torch.Tensor],
        *,
        max_width: int = 16,
        non_blocking: bool = True,
        force_staging: bool = False,
    ) -> None:
        if len(buffers) != layout.num_layers:
            raise ValueError(f"{len(buffers)} buffers for {layout.num_layers} layers")
        for offset, buffer in zip(layout.layer_offsets_bytes, buffers, strict=True):
            if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
                raise ValueError("a KV buffer must be a contiguous 1-d uint8 tensor")
            if offset + layout.layer_extent_bytes() > buffer.numel():
                raise ValueError(
                    f"a layer at byte {offset} reaches past its {buffer.numel()}-byte buffer"
                )
        self.device = buffers[0].device
        if any(buffer.device != self.device for buffer in buffers):
            raise ValueError("all KV buffers must be on one device")
        self.geometry = RunGeometry(layout, [id(buffer) for buffer in buffers])
        g = self.geometry
        distinct = list({id(buffer): buffer for buffer in buffers}.values())
        regions = [
            distinct[s.buffer][s.base_bytes : s.base_bytes + s.num_runs * g.run_bytes]
            for s in g.segments
        ]
        self.width = _widest(g.run_bytes, [r.data_ptr() for r in regions], max_width)
        self._runs = [_as_runs(region, g.run_bytes, self.width) for region in regions]
        self.non_blocking = non_blocking
        self.force_staging = force_staging

    # -----------------------------------------------------------------------------------------
    # Public
    # -----------------------------------------------------------------------------------------

    def gather(self, pool: torch.Tensor, copies: Sequence[ChunkCopy]) -> int:
        """Copies each chunk's blocks into its slot of ``pool``; returns the bytes written."""
        _check_pool(pool)
        self.geometry.check_copies(copies, pool.numel(), store=True)
        for group in _groups(copies):
            width = self._group_width(pool, group)
            target, staged = self._region(pool, group, width)
            if len(self.geometry.segments) == 1:
                index = self._index(self._indices(group, skip=False, segment=0))
                torch.index_select(self._runs_of(0, width), 0, index, out=target)
            else:
                per_object = target.view(len(group), -1, target.shape[1])
                for number, segment in enumerate(self.geometry.segments):
                    index = self._index(self._indices(group, skip=False, segment=number))
                    gathered = self._runs_of(number, width).index_select(0, index)
                    lo, hi = self._object_span(segment, len(group[0].block_ids))
                    per_object[:, lo:hi].copy_(gathered.view(len(group), hi - lo, -1))
            if staged:
                _region_of(pool, group, self.geometry.run_bytes, width).copy_(
                    target, non_blocking=self.non_blocking
                )
        return sum(copy.slot.nbytes for copy in copies)

    def scatter(self, pool: torch.Tensor, copies: Sequence[ChunkCopy]) -> int:
        """Copies each slot of ``pool`` into its chunk's blocks, except the first
        ``skip_blocks`` of each chunk; returns the bytes written into the KV."""
        _check_pool(pool)
        g = self.geometry
        g.check_copies(copies, pool.numel(), store=False)
        kept = [copy for copy in copies if copy.skip_blocks < len(copy.block_ids)]
        for group in _groups(kept):
            width = self._group_width(pool, group)
            source = _region_of(pool, group, self.geometry.run_bytes, width)
            if self.force_staging or pool.device != self.device:
                source = source.to(self.device, non_blocking=self.non_blocking)
            whole = len(g.segments) == 1 and not any(copy.skip_blocks for copy in group)
            for number, segment in enumerate(g.segments):
                index = self._index(self._indices(group, skip=True, segment=number))
                part = source if whole else self._kept_part(source, group, segment)
                self._runs_of(number, width).index_copy_(0, index, part)
        return sum(
            (len(copy.block_ids) - copy.skip_blocks) * g.object_block_bytes for copy in copies
        )

    # -----------------------------------------------------------------------------------------
    # Internal
    # -----------------------------------------------------------------------------------------

    def _indices(self, group: list[ChunkCopy], skip: bool, segment: int) -> np.ndarray:
        """The run indices of one segment for a whole group, in the group's object order."""
        if not skip and len(self.geometry.segments) == 1:
            whole = self.geometry.back_to_back(group, 1 << 62)
            if whole is not None:
                return whole.reshape(-1)
        per_copy = self.geometry.indices(group, skip)
        return np.concatenate([indices[segment].reshape(-1) for indices in per_copy])

    def _index(self, indices: np.ndarray) -> torch.Tensor:
        """The indices on the KV's device. On a GPU they go through page-locked memory: a
        copy from pageable memory may wait for the stream, i.e. for the engine's event, and
        hold the server's one thread that long."""
        host = torch.from_numpy(np.ascontiguousarray(indices, dtype=np.int64))
        if self.device.type == "cuda":
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)

    def _runs_of(self, segment: int, width: int) -> torch.Tensor:
        runs = self._runs[segment]
        return runs if width == self.width else runs.view(torch.uint8).view(ELEMENT_TYPES[width])

    def _group_width(self, pool: torch.Tensor, group: list[ChunkCopy]) -> int:
        address = pool.data_ptr() + group[0].slot.offset
        return _widest(self.geometry.run_bytes, [address], self.width)

    def _region(
        self, pool: torch.Tensor, group: list[ChunkCopy], width: int
    ) -> tuple[torch.Tensor, bool]:
        """Where a store gathers a group: its pool region, or a staging tensor on the KV's
        device (True) when the pool is elsewhere."""
        region = _region_of(pool, group, self.geometry.run_bytes, width)
        if pool.device == self.device and not self.force_staging:
            return region, False
        return torch.empty_like(region, device=self.device), True

    def _object_span(self, segment: Segment, num_blocks: int) -> tuple[int, int]:
        """Runs of one object (of ``num_blocks`` blocks) that ``segment``'s layers occupy."""
        per_layer = int(np.prod(self.geometry.run_shape(num_blocks)))
        return segment.first_layer * per_layer, (segment.first_layer + segment.num_layers) * (
            per_layer
        )

    def _kept_part(
        self, source: torch.Tensor, group: list[ChunkCopy], segment: Segment
    ) -> torch.Tensor:
        """The runs of ``segment``'s layers past each chunk's skipped blocks, in index order."""
        g = self.geometry
        parts = []
        offset = 0
        for copy in group:
            n = len(copy.block_ids)
            obj = source[offset : offset + n * g.object_block_bytes // g.run_bytes]
            offset += len(obj)
            shaped = obj.view(g.num_layers, *g.run_shape(n), source.shape[1])
            layers = shaped[segment.first_layer : segment.first_layer + segment.num_layers]
            parts.append(layers[g.block_axis_slice(copy.skip_blocks)].reshape(-1, source.shape[1]))
        return torch.cat(parts) if len(parts) > 1 else parts[0]


def _groups(copies: Sequence[ChunkCopy]) -> list[list[ChunkCopy]]:
    """Consecutive copies of one chunk length whose slots lie back to back."""
    groups: list[list[ChunkCopy]] = []
    for copy in copies:
        last = groups[-1][-1] if groups else None
        if (
            last is not None
            and last.slot.offset + last.slot.nbytes == copy.slot.offset
            and len(last.block_ids) == len(copy.block_ids)
        ):
            groups[-1].append(copy)
        else:
            groups.append([copy])
    return groups


def _region_of(
    pool: torch.Tensor, group: list[ChunkCopy], run_bytes: int, width: int
) -> torch.Tensor:
    """A group's slots as one tensor of runs."""
    start = group[0].slot.offset
    end = group[-1].slot.offset + group[-1].slot.nbytes
    return _as_runs(pool[start:end], run_bytes, width)


def _as_runs(region: torch.Tensor, run_bytes: int, width: int) -> torch.Tensor:
    return region.view(ELEMENT_TYPES[width]).view(-1, run_bytes // width)


def _widest(run_bytes: int, addresses: Sequence[int], cap: int) -> int:
    """The widest element width up to ``cap`` dividing the run size and every address."""
    for width in ELEMENT_TYPES:
        if width <= cap and run_bytes % width == 0 and all(a % width == 0 for a in addresses):
            return width
    return 1


def _check_pool(pool: torch.Tensor) -> None:
    if pool.dtype != torch.uint8 or pool.dim() != 1 or not pool.is_contiguous():
        raise ValueError("a pool must be a contiguous 1-d uint8 tensor")
