"""The spans of tier operations, in one place (names and attributes in
``testbed.core.telemetry.attributes``): each is parented on the request that caused it (the
store that committed or evicted, the lookup that prefetched) and carries the tier, bytes and
wait. Runs in the cache server process, on its loop; a no-op when tracing is off."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

from server.objects import CacheObject, Eviction
from server.tiers.io import TierJob
from testbed.core import telemetry
from testbed.core.telemetry import attributes as a

_MAX_SESSIONS = 64


class _TierLike(Protocol):
    kind: str
    index: Any


def _ns(monotonic_s: float) -> int:
    """A monotonic instant as the wall-clock nanoseconds spans are stamped with."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def _where(name: str, tier: _TierLike) -> dict[str, Any]:
    return {a.TIER: name, a.TIER_KIND: tier.kind}


def _occupancy(tier: _TierLike) -> dict[str, Any]:
    return {a.USED_BYTES: tier.index.used_bytes, a.CAPACITY_BYTES: tier.index.capacity_bytes}


def _instant(name: str, parent: str, attributes: dict[str, Any], links: Sequence[str] = ()) -> None:
    """A span of something done at once, on the loop (its duration: the span's own cost)."""
    telemetry.start_span(name, parent=parent, links=links, attributes=attributes).end()


def tier_io(
    name: str, tier: _TierLike, job: TierJob, nbytes: int, reason: str, parent: str
) -> None:
    """One read or write below L1, from its submission to its end (``wait_ms``: queued)."""
    if not telemetry.enabled():
        return
    span = telemetry.start_span(
        a.SERVER_TIER_READ if job.kind == "read" else a.SERVER_TIER_WRITE,
        parent=parent,
        start_time_ns=_ns(job.submitted_at),
        attributes={
            **_where(name, tier),
            a.BYTES: nbytes,
            a.WAIT_MS: (job.started_at - job.submitted_at) * 1e3,
            a.OK: job.ok,
            a.REASON: reason,
            **_occupancy(tier),
        },
    )
    if not job.ok:
        span.set_attribute(a.TIER_CAUSE, job.cause or "io_error")
        telemetry.fail(span, f"{job.kind} failed: {job.cause or 'io_error'}")
    span.end(end_time=_ns(job.ended_at))


def promoted(
    name: str, tier: _TierLike, obj: CacheObject, policy: str, job: TierJob, parent: str
) -> None:
    """An object read below L1 committed in L1 (``wait_ms``: from the prefetch's start)."""
    if not telemetry.enabled():
        return
    wait_ms = (time.monotonic() - job.submitted_at) * 1e3
    _instant(
        a.SERVER_TIER_PROMOTE,
        parent,
        {**_where(name, tier), a.BYTES: obj.nbytes, a.WAIT_MS: wait_ms,
         a.TIER_PROMOTE_POLICY: policy, a.SESSION_ID: obj.storer},
    )  # fmt: skip


def demoted(objects: Sequence[CacheObject], parent: str) -> None:
    """L1 evictions written down (``write_back``)."""
    if not objects or not telemetry.enabled():
        return
    nbytes = sum(obj.nbytes for obj in objects)
    _instant(
        a.SERVER_TIER_DEMOTE,
        parent,
        {a.EVICTED_OBJECTS: len(objects), a.BYTES: nbytes, a.TIER_WRITE_POLICY: "write_back"},
        links=[obj.origin for obj in objects if obj.origin][:_MAX_SESSIONS],
    )


def tier_evicted(name: str, tier: _TierLike, eviction: Eviction, parent: str) -> None:
    """A tier below L1 evicting (its own policy) to make room for a write."""
    if not telemetry.enabled():
        return
    _instant(
        a.SERVER_TIER_EVICT,
        parent,
        {**_where(name, tier), a.EVICTED_OBJECTS: len(eviction.objects),
         a.EVICTED_BYTES: eviction.nbytes, a.POLICY: tier.index.policy.name,
         **_occupancy(tier)},
    )  # fmt: skip


def prefetch_started(
    parent: str, session_id: str, by_tier: dict[str, int], nbytes: int, policy: str
) -> None:
    """A lookup's chunks found below L1 and sent for (their reads and promotions follow)."""
    if not telemetry.enabled():
        return
    _instant(
        a.SERVER_TIER_PREFETCH,
        parent,
        {a.SESSION_ID: session_id, a.CHUNKS: sum(by_tier.values()), a.BYTES: nbytes,
         a.TIER_KIND: sorted(by_tier), a.PREFETCH_POLICY: policy},
    )  # fmt: skip
