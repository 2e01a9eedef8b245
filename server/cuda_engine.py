"""Server-side copies between an engine's CUDA KV, opened through CUDA IPC, and the pool.

Runs in the cache server (``server`` transfer mode with CUDA KV: LMCache's server-driven mode
on GPU), imported only when a worker registers CUDA KV. The worker exported each KV storage
once (``connector.cuda_ipc``); :class:`CudaEngineKV` opens them on the local device with the
same UUID and copies with ``testbed.core.torch_block_copy`` on a stream of its own, in the object
layout every other copy path uses. The pool is a ``pinned-host`` or ``gpu`` pool
(``server.cuda_pools``): its :attr:`tensor`.

Ordering, per operation: :meth:`begin` makes the stream wait on the worker's *ready* event (so
no copy reads a block before the forward pass that wrote it, nor writes one before the last
that read it); the copies are issued asynchronously; :meth:`end` records a *done* event and
returns its descriptor (for the worker) and the event itself (for :meth:`settle`, which the
service calls before a slot may be reused: a commit, an abort, an expiry). Done events come
from a ring: an event recorded again by a later operation only makes a wait on it longer, since
the stream runs operations in order.

:meth:`close` (the worker left, died or registered again) waits for the stream, then drops the
mappings: torch closes each IPC handle when its last storage goes, and its reference counter
tells the worker's process that the block is free again.
"""

from __future__ import annotations

import torch

from testbed.core import protocol as p
from testbed.core.block_runs import ChunkCopy
from testbed.core.torch_block_copy import TorchBlockCopier

DONE_EVENTS = 64
"""Done events per engine (a ring)."""


def find_device(uuid: str) -> int:
    """The local index of the GPU whose UUID is ``uuid``; ``ValueError`` if none is visible."""
    if not torch.cuda.is_available():
        raise ValueError("this server sees no CUDA device; it cannot map CUDA KV")
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return index
    raise ValueError(
        f"the worker's GPU {uuid} is not visible to this server (CUDA_VISIBLE_DEVICES?): "
        "run the server where it sees every worker's GPU"
    )


def open_storage(storage: p.CudaStorage, device: int) -> torch.UntypedStorage:
    """Opens one exported storage (torch's ``rebuild_cuda_tensor``, without its pickle)."""
    torch.cuda._lazy_init()
    with torch.cuda.device(device):
        return torch.UntypedStorage._new_shared_cuda(
            device,
            storage.ipc_handle,
            storage.storage_bytes,
            storage.offset_bytes,
            storage.ref_counter_handle,
            storage.ref_counter_offset,
            storage.event_handle,
            storage.event_sync_required,
        )


class CudaEngineKV:
    """One worker's CUDA KV opened in the server; context manager."""

    def __init__(self, kv: p.CudaKV, *, max_width: int = 16) -> None:
        self.device_index = find_device(kv.storages[0].device_uuid)
        self.device = torch.device("cuda", self.device_index)
        self.uuid = kv.storages[0].device_uuid
        views = []
        for storage in kv.storages:
            opened = open_storage(storage, self.device_index)
            views.append(torch.empty(0, dtype=torch.uint8, device=self.device).set_(opened))
        buffers = [views[index] for index in kv.layer_storages]
        self._copier: TorchBlockCopier | None = TorchBlockCopier(
            kv.layout, buffers, max_width=max_width
        )
        self._stream: torch.cuda.Stream | None = torch.cuda.Stream(self.device)
        self._ready: dict[bytes, torch.cuda.Event] = {}
        with torch.cuda.device(self.device):
            self._done = [torch.cuda.Event(interprocess=True) for _ in range(DONE_EVENTS)]
        self._next_done = 0

    def begin(self, ready: p.CudaEvent | None) -> None:
        """Orders the operation's copies after the worker's ``ready`` event."""
        if ready is None:
            raise ValueError("an operation on CUDA KV must carry the engine's ready event")
        event = self._ready.get(ready.ipc_handle)
        if event is None:
            event = torch.cuda.Event.from_ipc_handle(self.device, ready.ipc_handle)
            self._ready[ready.ipc_handle] = event
        self._live_stream().wait_event(event)

    def store(self, pool: torch.Tensor, copies: list[ChunkCopy]) -> int:
        """Engine KV → pool, on the stream; returns the bytes it will have written."""
        with torch.cuda.stream(self._live_stream()):
            return self._live_copier().gather(pool, copies)

    def retrieve(self, pool: torch.Tensor, copies: list[ChunkCopy]) -> int:
        """Pool → engine KV, skipping each chunk's first ``skip_blocks``, on the stream."""
        with torch.cuda.stream(self._live_stream()):
            return self._live_copier().scatter(pool, copies)

    def end(self) -> tuple[p.CudaEvent, torch.cuda.Event]:
        """Records the done event of the operation's copies: its descriptor and the event."""
        event = self._done[self._next_done]
        self._next_done = (self._next_done + 1) % len(self._done)
        event.record(self._live_stream())
        return p.CudaEvent(device_uuid=self.uuid, ipc_handle=bytes(event.ipc_handle())), event

    @staticmethod
    def settle(done: torch.cuda.Event | None) -> None:
        """Returns once the copies that ``done`` follows have completed."""
        if done is not None:
            done.synchronize()

    def close(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
        self._stream = None
        self._copier = None
        self._ready.clear()
        self._done.clear()

    def __enter__(self) -> CudaEngineKV:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def stream(self) -> torch.cuda.Stream:
        """The stream the copies run on (benchmarks time them there)."""
        return self._live_stream()

    def _live_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            raise ValueError("the worker's CUDA KV is closed")
        return self._stream

    def _live_copier(self) -> TorchBlockCopier:
        if self._copier is None:
            raise ValueError("the worker's CUDA KV is closed")
        return self._copier
