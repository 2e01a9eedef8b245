"""Server-driven transfers: the server copies between the engine's KV and the pool itself.

Runs in the cache server process, for :class:`server.transfers.Transfers` when the worker
registered its KV (a shared-memory file on CPU, CUDA IPC handles on GPU; ``server.kv_copier``,
``server.cuda_engine``). Copies go an item at a time, and other clients are served in between
(generators that ``yield`` between slices, as the handlers do).
"""

from __future__ import annotations

import time
from collections.abc import Generator
from typing import Any

from server.cache import KVCache
from server.context import Call, ServiceError
from server.objects import CacheObject
from server.state import Worker
from testbed.core import protocol as p
from testbed.core.block_copy import item_copies
from testbed.core.telemetry import attributes as a

Done = tuple[p.CudaEvent | None, Any]
"""The copies' done event: its descriptor for the worker and the server's own handle (both
``None`` for CPU copies, which are done when they return)."""


def store(
    cache: KVCache,
    call: Call,
    worker: Worker,
    req: p.StoreBegin,
    plans: list[p.ItemSlots],
    objects: list[CacheObject],
    per_chunk: int,
) -> Generator[None, None, Done]:
    """Copies the engine's blocks into the reserved slots, after the engine's ready event
    (CUDA); ``per_chunk`` blocks make a chunk. A failure drops the reservations once no copy
    can still write into them."""
    started = time.perf_counter()
    engine = worker.engine
    try:
        engine.begin(req.ready_event)
        for item, plan in zip(req.items, plans, strict=True):
            if len(item.block_ids) < len(item.chunk_hashes) * per_chunk:
                raise ValueError(
                    f"item of {len(item.chunk_hashes)} chunks names {len(item.block_ids)} blocks"
                )
            copies, _ = item_copies(item.block_ids, plan.slots, per_chunk)
            if copies:
                engine.store(worker.pool_buffer, copies)
                if call.spend(len(copies) * per_chunk):
                    yield
        done: Done = engine.end()
    except (ValueError, IndexError, OSError, RuntimeError) as exc:
        _settle_after_failure(engine)
        for obj in objects:
            cache.remove(obj)
        raise ServiceError("invalid", f"copying the engine's blocks failed: {exc}") from None
    call.span.set_attribute(a.COPY_MS, (time.perf_counter() - started) * 1e3)
    return done


def retrieve(
    call: Call, worker: Worker, req: p.RetrieveBegin, plans: list[p.ItemSlots], per_chunk: int
) -> Generator[None, None, tuple[list[bool], Done]]:
    """Copies the pinned objects into the engine's blocks (never the first ``skip_blocks`` of
    an item), after the engine's ready event (CUDA); returns which items were copied (a failed
    item's chunks count as missing: its plan says none present) and the done event. Raises
    ``invalid`` (nothing copied) when the copies cannot be ordered."""
    engine = worker.engine
    try:
        engine.begin(req.ready_event)
    except (ValueError, RuntimeError) as exc:
        raise ServiceError("invalid", f"cannot order the copies: {exc}") from None
    oks: list[bool] = []
    started = time.perf_counter()
    for item, plan in zip(req.items, plans, strict=True):
        copies, _ = item_copies(item.block_ids, plan.slots, per_chunk, item.skip_blocks)
        try:
            if copies:
                engine.retrieve(worker.pool_buffer, copies)
            oks.append(True)
        except (ValueError, IndexError, OSError, RuntimeError):
            plan.slots = [None] * len(plan.slots)  # nothing of it was loaded
            plan.num_present = 0
            oks.append(False)
        if call.spend(max(1, len(copies)) * per_chunk):
            yield
    done: Done = engine.end()
    call.span.set_attribute(a.COPY_MS, (time.perf_counter() - started) * 1e3)
    return oks, done


def _settle_after_failure(engine: Any) -> None:
    """Waits for whatever copies an operation had issued before it failed (CUDA), so that
    no slot it frees is still being written or read."""
    try:
        _, done = engine.end()
    except (ValueError, RuntimeError):
        return
    if done is not None:
        done.synchronize()
