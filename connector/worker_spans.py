"""The worker's spans: what a store or retrieve batch leaves for an analyst.

Every batch leaves one CLIENT span (``kvcache.connector.store`` / ``.retrieve``) parented on
its first request's context and linked to all of them, with the batch's size as attributes
and one ``kvcache.item`` event per request (its range, attempt, and for a failed load the
first token of the first failed block); at its end, what it moved and where its time went.
An operation the worker gave up on leaves a ``kvcache.connector.abort`` span under its own.
The store and retrieve state machines build every span through these functions, so both name
the same things the same way (attributes: ``testbed.core.telemetry.attributes``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from connector.ops import RetrieveOp, StoreOp
from testbed.core import protocol as p
from testbed.core import telemetry
from testbed.core.ranks import WorkerIdentity
from testbed.core.round_trips import RoundTrips
from testbed.core.telemetry import SpanKind
from testbed.core.telemetry import attributes as a

log = logging.getLogger(__name__)

Ops = Sequence[StoreOp] | Sequence[RetrieveOp]


@dataclass
class OpTiming(RoundTrips):
    """Where a batch's time went (milliseconds on its span): its round trips (each reply's
    :meth:`~testbed.core.round_trips.RoundTrips.took`), and"""

    step_wait_s: float = 0.0
    """Seconds the engine's step was held waiting for the replies (0 when the forward pass
    never waits on the network)."""
    copy_ms: float = 0.0
    """Milliseconds the worker spent copying between its KV and the pool."""


def start_batch(name: str, ops: Ops, identity: WorkerIdentity) -> tuple[telemetry.Span, int]:
    """The batch's CLIENT span, started now; and its start (wall clock, ns)."""
    started_ns = time.time_ns()
    span = telemetry.start_span(
        name,
        kind=SpanKind.CLIENT,
        parent=ops[0].traceparent,
        links=[op.traceparent for op in ops],
        attributes={
            a.NUM_REQUESTS: len(ops),
            a.REQUEST_IDS: [op.request_id for op in ops],
            a.KV_RANK: identity.kv_rank,
            a.RANK: identity.tp_rank,
            a.CHUNKS: sum(len(op.chunk_hashes) for op in ops),
            a.TOKENS: sum(op.end_token - op.start_token for op in ops),
            a.BLOCKS: sum(len(op.block_ids) for op in ops),
        },
        start_time_ns=started_ns,
    )
    return span, started_ns


def end_batch(span: telemetry.Span, started_ns: int) -> float:
    """Ends the span now; its duration in seconds (what the connector stats record)."""
    ended_ns = time.time_ns()
    span.end(end_time=ended_ns)
    return (ended_ns - started_ns) / 1e9


def give_up(span: telemetry.Span, reason: str) -> None:
    """The batch failed as a whole: logged, and the span says why."""
    log.warning("%s", reason)
    span.set_attributes({a.OK: False, a.ERROR: reason})
    telemetry.fail(span, reason)


@contextmanager
def aborting(op_id: int, op_span: telemetry.Span, reason: str) -> Iterator[None]:
    """The ``kvcache.connector.abort`` span of an operation given up on, under its own."""
    with telemetry.traced(
        a.CONNECTOR_ABORT,
        kind=SpanKind.CLIENT,
        parent=telemetry.traceparent_of(op_span),
        attributes={a.OP_ID: op_id, a.ABANDONED: True, a.REASON: reason[:500]},
    ):
        yield


def op_attributes(op: StoreOp | RetrieveOp) -> dict[str, Any]:
    """One request's part of a batch: the attributes of its ``kvcache.item`` event."""
    attributes: dict[str, Any] = {
        a.REQUEST_ID: op.request_id,
        a.REQUEST_ATTEMPT: op.attempt,
        a.CHUNKS: len(op.chunk_hashes),
        a.TOKENS: op.end_token - op.start_token,
        a.BLOCKS: len(op.block_ids),
        a.RANGE_START: op.start_token,
        a.RANGE_END: op.end_token,
    }
    if isinstance(op, RetrieveOp):
        attributes[a.SKIP_FIRST_N_TOKENS] = op.skip_first_n_tokens
    return attributes


def loaded_item(op: RetrieveOp) -> dict[str, Any]:
    """The item event of a request whose load succeeded."""
    return {**op_attributes(op), a.OK: True}


def failed_item(op: RetrieveOp, failed_blocks: list[int], block_size: int) -> dict[str, Any]:
    """A failed load's item event: the first token of its first failed block."""
    failed = set(failed_blocks)
    index = next((i for i, block in enumerate(op.block_ids) if block in failed), None)
    first = op.end_token if index is None else op.start_token + index * block_size
    return {**op_attributes(op), a.OK: index is None, a.FIRST_FAILED_TOKEN: first}


def slot_bytes(items: Sequence[p.ItemSlots]) -> int:
    """Bytes of the pool slots the server gave the items."""
    return sum(slot.nbytes for item in items for slot in item.slots if slot is not None)


def store_ended(
    span: telemetry.Span,
    ops: Sequence[StoreOp],
    plan: p.StorePlan | None,
    *,
    ok: bool,
    num_committed: int,
    timing: OpTiming,
) -> int:
    """A store's item events and outcome on its span; the bytes it stored."""
    nbytes = slot_bytes(plan.items) if ok and plan is not None else 0
    for index, op in enumerate(ops):
        attributes = {**op_attributes(op), a.OK: ok}
        if plan is not None:
            item = plan.items[index]
            attributes[a.CHUNKS_WRITTEN] = sum(slot is not None for slot in item.slots)
            attributes[a.CHUNKS_PRESENT] = item.num_present
            attributes[a.CHUNKS_FULL] = item.num_full
            attributes[a.BYTES] = slot_bytes([item]) if ok else 0
        span.add_event(a.ITEM_EVENT, attributes)
    span.set_attributes(
        {
            a.OK: ok,
            a.CHUNKS_WRITTEN: num_committed,
            a.BYTES: nbytes,
            a.COPY_MS: timing.copy_ms,
            **timing.attributes(),
            a.STEP_WAIT_MS: timing.step_wait_s * 1e3,
            a.SERVER_COPIED: bool(plan is not None and plan.copied),
        }
    )
    if plan is not None:
        span.set_attributes(
            {
                a.CHUNKS_PRESENT: sum(item.num_present for item in plan.items),
                a.CHUNKS_FULL: sum(item.num_full for item in plan.items),
            }
        )
    return nbytes


def retrieve_ended(
    span: telemetry.Span,
    plan: p.RetrievePlan,
    *,
    oks: list[bool],
    confirmed: bool,
    nbytes: int,
    num_locks_released: int,
    timing: OpTiming,
    wait_s: float,
) -> None:
    """A retrieve's outcome on its span (its item events are added as it reports them)."""
    span.set_attributes(
        {
            a.OK: confirmed and all(oks),
            a.CHUNKS_MISSING: sum(not ok for ok in oks),
            a.BYTES: nbytes,
            a.LOCKS_RELEASED: num_locks_released,
            a.COPY_MS: timing.copy_ms,
            **timing.attributes(),
            a.SERVER_COPIED: plan.copied,
            a.WAIT_MS: wait_s * 1e3,
        }
    )
