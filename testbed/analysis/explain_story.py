"""A request's story: the types :mod:`testbed.analysis.explain` returns and their text.

:class:`RequestStory` holds the request's lookup, its prompt as token ranges of one category
each (:func:`segments`, the rules of :func:`testbed.analysis.attribution.attribute` applied to
one request), its first miss (:class:`Miss`) and, in a fleet, its routing (:class:`Route`);
``str(story)`` is the readable form ``kvtb explain RUN REQUEST_ID`` prints.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from testbed.analysis import attribution as acc
from testbed.analysis.chunk_causes import CHUNK_HIT
from testbed.core.sizes import format_bytes


@dataclass(frozen=True)
class Segment:
    """Prompt tokens ``[start_token, end_token)``, all of one category."""

    start_token: int
    end_token: int
    category: str

    @property
    def num_tokens(self) -> int:
        return self.end_token - self.start_token


@dataclass(frozen=True)
class ChunkLookup:
    """One chunk as the request's first lookup saw it."""

    position: int
    status: str
    """hit, in_flight or absent."""
    cause: str
    """hit, in_flight, capacity or cold: the chunk's own."""
    effective: str
    """The cause its tokens take: a hit behind an earlier miss takes that miss's cause."""


@dataclass(frozen=True)
class Miss:
    """The first prompt token the engine computed, and why."""

    cause: str
    start_token: int
    position: int | None
    """The chunk whose state explains the miss (for a hit behind a miss, the earlier miss)."""
    reason: str
    """One sentence."""
    chunk_hash: str | None = None
    evict_span_id: str | None = None
    evict_cause: str | None = None
    """capacity (evicted for room), drop (an admin or fault drop) or expire."""
    storer_session_id: str | None = None
    storer_request_id: str | None = None
    storer_workload_request_id: str | None = None
    failed_ranks: dict[int, int] = field(default_factory=dict)
    """load_failed: TP rank → first failed token of its retrieve."""
    missing_ranks: tuple[int, ...] = ()
    """load_failed: TP ranks with no retrieve item although tokens were promised."""
    retrieve_span_ids: tuple[str, ...] = ()
    lookup_error: str | None = None
    holder_instance: int | None = None
    """routing: the instance whose prefix cache held the tokens at the decision."""


@dataclass(frozen=True)
class PeerCopy:
    """Chunks a peer server copied into the request's server for its lookup (``--p2p``)."""

    peer: str
    """The peer's name (a fleet's ``instance N``)."""
    url: str
    chunks: int
    nbytes: int
    wait_ms: float

    def __str__(self) -> str:
        return (
            f"copied from {self.peer} ({self.url}): {self.chunks} chunks, "
            f"{format_bytes(self.nbytes)}, the lookup waited {self.wait_ms:.1f} ms"
        )


@dataclass(frozen=True)
class Route:
    """The fleet's routing decision for the request (its ``kvcache.route`` span)."""

    router: str
    instance: int
    cached_tokens: tuple[int, ...]
    """Per instance, the request's prefix its prefix cache held at the decision."""
    costs: tuple[float, ...] | None
    """Per instance, the router's cost (the lowest wins); ``None``: it weighs none."""
    load_tokens: tuple[float, ...]

    def __str__(self) -> str:
        line = f"routed by {self.router} to instance {self.instance}"
        parts = [f"cached tokens {per_instance(self.cached_tokens)}"]
        if self.costs is not None:
            parts.append(f"costs {per_instance(self.costs)}")
        parts.append(f"load tokens {per_instance(self.load_tokens)}")
        return f"{line} ({'; '.join(parts)})"


@dataclass(frozen=True)
class RequestStory:
    request_id: str
    workload_request_id: str | None
    session_id: str
    group: str | None
    trace_id: str
    prompt_tokens: int
    chunk_size: int
    tp_size: int
    engine_hit_tokens: int
    server_hit_tokens: int | None
    promised_tokens: int
    external_hit_tokens: int
    lookup_status: str
    tokens: dict[str, int]
    """Every category of :data:`testbed.analysis.attribution.CATEGORIES` (they sum to P)."""
    segments: tuple[Segment, ...]
    lookup: tuple[ChunkLookup, ...]
    first_miss: Miss | None
    causes_resolved: bool
    route: Route | None = None
    """Fleets: where the request went and why."""
    external_by_source: dict[str, int] | None = None
    """``external`` by the tier each token's chunk was matched in (``host``, ``disk``, ...)."""
    tier_traffic: dict[str, Any] | None = None
    """The run's tiers below L1 and their traffic (summary.json ``tiers``), when it had any."""
    peer_copies: tuple[PeerCopy, ...] = ()
    """What peers copied for the request's lookups (``kvcache.server.peer_fetch`` spans)."""

    def __str__(self) -> str:
        names = [f"workload {self.workload_request_id}"] if self.workload_request_id else []
        names += [f"group {self.group}"] if self.group else []
        names += [f"session {self.session_id}", f"trace {self.trace_id}"]
        lines = [
            f"request {self.request_id} ({', '.join(names)})",
            f"  {self.prompt_tokens} prompt tokens, chunk size {self.chunk_size}, "
            f"TP {self.tp_size}",
        ]
        if self.route is not None:
            lines.append(f"  {self.route}")
        lines += [
            "  lookup: " + self._lookup_line(),
            f"  vLLM's own prefix cache: {self.engine_hit_tokens} tokens; promised to load: "
            f"{self.promised_tokens}; loaded: {self.external_hit_tokens}",
        ]
        split = {k: v for k, v in (self.external_by_source or {}).items() if v}
        if set(split) - {"host"}:
            lines.append(
                "  loaded by tier: " + ", ".join(f"{name} {n}" for name, n in split.items())
            )
        lines += [f"  {copy}" for copy in self.peer_copies]
        if self.tier_traffic:
            lines += tier_lines(self.tier_traffic)
        if self.lookup:
            lines.append("  chunks: " + ", ".join(chunk_text(c) for c in self.lookup))
        lines.append("  tokens:")
        ranges = [f"[{s.start_token}, {s.end_token})" for s in self.segments]
        range_width = max((len(r) for r in ranges), default=0)
        count_width = len(str(self.prompt_tokens))
        for text, segment in zip(ranges, self.segments, strict=True):
            count = f"{segment.num_tokens:>{count_width}}"
            lines.append(f"    {text:<{range_width}}  {count}  {segment.category}")
        if self.first_miss is None:
            lines.append("  no miss: every prompt token was a hit")
        else:
            miss = self.first_miss
            where = f" (chunk {miss.position})" if miss.position is not None else ""
            lines.append(f"  first miss: token {miss.start_token}{where}: {miss.cause}")
            lines.append(f"    {miss.reason}")
        if not self.causes_resolved:
            lines.append(
                "  note: the chunk log does not cover this request's lookup; chunks it missed "
                "count as cold"
            )
        return "\n".join(lines)

    def _lookup_line(self) -> str:
        if self.lookup_status == acc.LOOKUP_UNAVAILABLE:
            return "unavailable (the cache server did not answer)"
        if self.lookup_status == acc.LOOKUP_REFUSED:
            return "refused (the cache server's limits or this client's quota)"
        if self.lookup_status == acc.LOOKUP_NONE:
            return "none (the prompt has no complete chunk)"
        hit = self.server_hit_tokens or 0
        chunks = f" ({hit // self.chunk_size} of {len(self.lookup)} chunks)" if self.lookup else ""
        return f"ok, server hit {hit} tokens{chunks}"


def tier_lines(traffic: dict[str, Any]) -> list[str]:
    """The run's tier traffic (summary.json ``server_tiers`` by tier name, and
    ``server_tier_lookups``), a line per tier below L1."""
    lines = []
    for name, tier in (traffic.get("levels") or {}).items():
        lines.append(
            f"  run's tier {name} ({tier['kind']}, {format_bytes(tier['capacity_bytes'])}):"
            f" reads {tier['reads']} ({format_bytes(tier['read_bytes'])}), writes "
            f"{tier['writes']} ({format_bytes(tier['written_bytes'])}), promotions "
            f"{tier['promotions']}, demotions {tier['demotions']}, write-backs "
            f"{tier['write_backs']}, evictions {tier['evictions']}, failures {tier['failures']}, "
            f"dropped writes {tier['dropped_writes']}"
        )
    lines.append(
        f"  run's prefetch timeouts {traffic.get('prefetch_timeouts', 0)}, tier read failures "
        f"{traffic.get('tier_read_failures', 0)} (chunks)"
    )
    return lines


def segments(row: pd.Series, chunks: list[ChunkLookup], route: Route | None) -> list[Segment]:
    """The request's prompt as token ranges of one category each (same rules as
    :func:`testbed.analysis.attribution.attribute`, one request at a time)."""
    P, C = int(row["prompt_tokens"]), int(row["chunk_size"])
    E, X, L = (int(row[c]) for c in ("engine_hit_tokens", "external_hit_tokens", "promised_tokens"))
    hit = row["server_hit_tokens"]
    H = 0 if pd.isna(hit) else int(hit)
    last = max(P - 1, 0)
    low = E + L
    complete_end = (P // C) * C
    full_end = min(last, complete_end)
    pieces = [(0, E, "engine"), (E, E + X, "external"), (E + X, low, "load_failed")]
    if row["lookup_status"] in (acc.LOOKUP_UNAVAILABLE, acc.LOOKUP_REFUSED):
        pieces.append((low, full_end, str(row["lookup_status"])))
    else:
        held_end = (H // C) * C
        pieces.append((low, min(full_end, held_end), "engine_only"))
        effective = {c.position: c.effective for c in chunks}
        begin = max(low, held_end)
        for position in range(begin // C, -(-full_end // C)):
            cause = effective.get(position, "cold")
            cause = "cold" if cause == CHUNK_HIT else cause
            pieces.append((max(position * C, begin), min((position + 1) * C, full_end), cause))
    pieces.append((max(low, complete_end), last, "partial_chunk"))
    if route is not None:
        pieces = _carve_routing(pieces, low, last, route)
    if P > 0:
        pieces.append((last, P, "last_token"))
    merged: list[Segment] = []
    for start, end, category in pieces:
        if end <= start:
            continue
        if merged and merged[-1].category == category and merged[-1].end_token == start:
            merged[-1] = Segment(merged[-1].start_token, end, category)
        else:
            merged.append(Segment(start, end, category))
    return merged


def _carve_routing(
    pieces: list[tuple[int, int, str]], low: int, last: int, route: Route
) -> list[tuple[int, int, str]]:
    """``pieces`` with the ``routing`` range (:mod:`testbed.analysis.routing`) cut out of the
    computed ones and put in its place."""
    held = route.cached_tokens
    others = [tokens for i, tokens in enumerate(held) if i != route.instance]
    start = max(low, held[route.instance])
    end = max(min(max(others, default=0), last), start)
    if end <= start:
        return pieces
    carved = []
    for begin, finish, category in pieces:
        if finish <= begin or finish <= low:  # hits and failed loads stay
            carved.append((begin, finish, category))
            continue
        carved.append((begin, min(finish, start), category))
        carved.append((max(begin, end), finish, category))
    carved.append((start, end, "routing"))
    return sorted((p for p in carved if p[1] > p[0]), key=lambda p: p[0])


def per_instance(values: tuple[float, ...] | tuple[int, ...]) -> str:
    return ", ".join(f"i{i} {value:g}" for i, value in enumerate(values))


def chunk_text(chunk: ChunkLookup) -> str:
    if chunk.status == CHUNK_HIT:
        return f"{chunk.position} hit" + (
            f" (behind a miss: {chunk.effective})" if chunk.effective != CHUNK_HIT else ""
        )
    if chunk.status == chunk.cause:
        return f"{chunk.position} {chunk.status}"
    return f"{chunk.position} {chunk.status} ({chunk.cause})"
