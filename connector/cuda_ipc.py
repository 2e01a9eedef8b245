"""The worker's side of CUDA IPC: its KV storages exported once, and events that order copies.

Runs in each worker process whose KV lives in CUDA memory, in the ``server`` transfer mode
(the cache server maps the KV and copies, as LMCache's server-driven mode does on GPU):

- :func:`describe_cuda_kv` turns the KV tensors into a :class:`testbed.core.protocol.CudaKV`: each
  distinct storage exported once (``UntypedStorage._share_cuda_``: the IPC handle of its
  ``cudaMalloc`` block, where it lies in it, torch's shared reference counter) and every layer
  located in one by its byte offset, shape and strides: views that are not contiguous export
  their physical layout, nothing is copied;
- :class:`ReadyEvents` hands out interprocess events: one is recorded on the KV device's current
  stream when a store or retrieve is submitted (after the forward pass that wrote the blocks,
  or the last one that read them) and travels with the operation; it goes back to the ring only
  when the operation has completed, so a later record never changes what the server waits for;
- :meth:`ReadyEvents.opened` opens the server's *done* events (cached by handle): the worker's
  operation completes when :meth:`DoneEvent.done` says so (a query, never a wait), or its stream
  waits on it (:meth:`DoneEvent.order_stream`) where a forward pass must not overtake a copy.

torch is imported by the caller (this module is only reached with CUDA KV); nothing here runs
at import. The export keeps the tensors alive: torch's reference counter keeps each block
allocated while the server holds it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from connector.kv_copy import PagedKV
from testbed.core import protocol as p
from testbed.core.closing import Closing

_POLL_S = 50e-6
"""How often :meth:`DoneEvent.done_by` asks whether the server's copies completed."""

ShareStorage = Callable[[torch.UntypedStorage], p.CudaStorage]
"""Exports one storage (:func:`share_storage`; tests substitute one for CPU tensors)."""


def describe_cuda_kv(kv: PagedKV, share: ShareStorage) -> p.CudaKV:
    """The KV as the server will open it: every distinct storage once, in order of first use,
    and per layer which storage and where in it (``share`` exports a storage)."""
    storages: list[p.CudaStorage] = []
    numbers: dict[int, int] = {}
    layer_storages = []
    offsets = []
    for layer in kv.layers:
        storage = layer.untyped_storage()
        key = storage.data_ptr()
        if key not in numbers:
            numbers[key] = len(storages)
            storages.append(share(storage))
        layer_storages.append(numbers[key])
        offsets.append(int(layer.storage_offset()) * layer.element_size())
    return p.CudaKV(
        storages=storages, layer_storages=layer_storages, layout=kv.paged_layout(offsets)
    )


def device_uuid(device: torch.device | int) -> str:
    """The GPU's UUID (indices differ between processes; UUIDs do not)."""
    return str(torch.cuda.get_device_properties(device).uuid)


def share_storage(storage: torch.UntypedStorage) -> p.CudaStorage:
    """Exports one CUDA storage through CUDA IPC (torch's own mechanism, the fields its tensor
    reduction sends, as a typed struct)."""
    (
        device,
        handle,
        storage_bytes,
        offset_bytes,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = storage._share_cuda_()
    return p.CudaStorage(
        device_uuid=device_uuid(device),
        ipc_handle=bytes(handle),
        storage_bytes=int(storage_bytes),
        offset_bytes=int(offset_bytes),
        ref_counter_handle=bytes(ref_counter_handle or b""),
        ref_counter_offset=int(ref_counter_offset or 0),
        event_handle=bytes(event_handle or b""),
        event_sync_required=bool(event_sync_required),
    )


@dataclass
class DoneEvent:
    """A server's done event opened in this process."""

    event: torch.cuda.Event

    def done(self) -> bool:
        """Whether the server's copies it follows have completed (never blocks)."""
        return bool(self.event.query())

    def wait(self) -> None:
        """Blocks until they have (synchronous loads only: the forward pass is next)."""
        self.event.synchronize()

    def done_by(self, deadline: float) -> bool:
        """Whether they have completed, polling until ``deadline`` (``time.monotonic``) at
        most."""
        while not self.done():
            if time.monotonic() >= deadline:
                return False
            time.sleep(_POLL_S)
        return True

    def order_stream(self, device: torch.device) -> None:
        """Makes later work on ``device``'s current stream wait for the copies (a preempted
        request's blocks are not overwritten before the server has read them); the host goes
        on at once."""
        torch.cuda.current_stream(device).wait_event(self.event)


class ReadyEvents:
    """A ring of interprocess events on ``device``; each is lent to one operation at a time."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.uuid = device_uuid(device)
        self._free: list[torch.cuda.Event] = []
        self._lent: dict[int, torch.cuda.Event] = {}
        self._opened: dict[bytes, DoneEvent] = {}
        self._next_token = 0

    def record(self) -> tuple[int, p.CudaEvent]:
        """Records an event on the device's current stream now; returns the token that
        :meth:`release` takes back and the descriptor the operation carries."""
        event = self._free.pop() if self._free else torch.cuda.Event(interprocess=True)
        event.record(torch.cuda.current_stream(self.device))
        token = self._next_token
        self._next_token += 1
        self._lent[token] = event
        return token, p.CudaEvent(device_uuid=self.uuid, ipc_handle=bytes(event.ipc_handle()))

    def release(self, token: int | None) -> None:
        """The operation that carried the event has completed (or was given up)."""
        event = self._lent.pop(token, None) if token is not None else None
        if event is not None:
            self._free.append(event)

    def opened(self, descriptor: p.CudaEvent) -> DoneEvent:
        """The server's event, opened once per handle."""
        done = self._opened.get(descriptor.ipc_handle)
        if done is None:
            event = torch.cuda.Event.from_ipc_handle(self.device, descriptor.ipc_handle)
            done = self._opened[descriptor.ipc_handle] = DoneEvent(event)
        return done

    @property
    def num_lent(self) -> int:
        return len(self._lent)

    def close(self) -> None:
        self._free.clear()
        self._lent.clear()
        self._opened.clear()


class CudaExport(Closing):
    """A worker's CUDA KV exported for the server: the registration's descriptor and the
    events of its operations. Context manager."""

    def __init__(self, kv: PagedKV, share: ShareStorage = share_storage) -> None:
        device = kv.layers[0].device
        if device.type != "cuda":
            raise ValueError(f"CUDA IPC exports CUDA KV, not {device.type} tensors")
        self.kv = kv
        self.description = describe_cuda_kv(kv, share)
        self.events = ReadyEvents(device)

    def close(self) -> None:
        self.events.close()
