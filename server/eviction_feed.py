"""The chunks removed from the cache, numbered in order, for clients that announce what it holds.

Runs in the cache server process. A vLLM scheduler that publishes KV events (block stored /
removed in the external cache) must learn of evictions the server decides, its own and those
other engines' stores cause: every removal of a committed object (an eviction for room, an
administrative drop) is appended here with the next number, and a lookup that asks
(``Lookup.evictions_after``) gets the removals of its model and world size since the number it
last saw, in its reply (a client starts at the number ``GetConfig`` tells it, having announced
nothing before). The feed keeps the latest ``max_entries`` removals; a client further behind
is told its knowledge is lost (and so is one ahead of it: the server restarted).

Commits in L1 are recorded too once a client asked for them (``Lookup.commits``: a
scheduler's lookup mirror, ``connector.mirror``), as entries of medium L1 with ``stored``;
they reach only a lookup that asks. Before the first such lookup nothing records them, so a
server without mirrors numbers its removals as before.

The tiers below L1 (``server.tiers.hierarchy``) record their own changes in the same numbered
stream, under the tier's hit-source name (``disk``, ``remote``): a chunk committed in the tier
(stored) and one it removed (evicted, or forgotten as unreadable). They reach only a lookup
that asks for them (``Lookup.tier_events``), as ``LookupResult.tier_changes``; a client that
does not ask sees the L1 removals alone, as before.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from server.objects import ObjectKey
from testbed.core import protocol as p
from testbed.core.keys import ChunkHash

DEFAULT_MAX_ENTRIES = 1 << 16


L1 = ""
"""The medium of an entry about L1 (the shared-memory pool); a tier below it: its kind."""


@dataclass(frozen=True)
class FeedSlice:
    """Removals from L1 after a client's number: ``(number, cache salt, chunk hash)`` oldest
    first, the number of the last entry covered, and whether entries the client asked for are
    unknown; when asked, the changes of the tiers below L1 too, as ``(number, cache salt,
    chunk hash, medium, stored)``."""

    chunks: list[tuple[int, str, ChunkHash]]
    seq: int
    lost: bool
    tier_changes: list[tuple[int, str, ChunkHash, str, bool]] = field(default_factory=list)
    committed: list[tuple[int, str, ChunkHash]] = field(default_factory=list)
    """When asked: L1's commits, as ``(number, cache salt, chunk hash)``."""


@dataclass
class EvictionFeed:
    max_entries: int = DEFAULT_MAX_ENTRIES
    seq: int = 0
    """The number of the latest entry (0: none yet)."""
    commits_wanted: bool = False
    """A client asked for L1's commits: they are recorded from then on (:meth:`committed`)."""
    _entries: deque[tuple[int, str, int, str, ChunkHash, str, bool]] = field(default_factory=deque)

    def record(self, keys: Iterable[ObjectKey], medium: str = L1, stored: bool = False) -> None:
        """Appends the chunks of ``keys`` removed together from ``medium`` (or, ``stored``,
        committed in a tier below L1), one entry per chunk and namespace, whatever the number
        of its ranks."""
        seen: set[tuple[str, int, str, ChunkHash]] = set()
        for key in keys:
            chunk = (key.model, key.world_size, key.cache_salt, key.chunk_hash)
            if chunk in seen:
                continue
            seen.add(chunk)
            self.seq += 1
            self._entries.append((self.seq, *chunk, medium, stored))
            if len(self._entries) > self.max_entries:
                self._entries.popleft()

    def committed(self, keys: Iterable[ObjectKey]) -> None:
        """Appends the chunks of ``keys`` committed together in L1, once commits are wanted."""
        if self.commits_wanted:
            self.record(keys, L1, stored=True)

    def since(
        self,
        after: int,
        model: str,
        world_size: int,
        limit: int,
        tiers: bool = False,
        commits: bool = False,
    ) -> FeedSlice:
        """Up to ``limit`` entries of ``(model, world_size)`` numbered above ``after``: L1's
        removals, the tiers' changes when ``tiers``, L1's commits when ``commits``."""
        first = self._entries[0][0] if self._entries else self.seq + 1
        if after > self.seq or after < first - 1:
            return FeedSlice([], self.seq, lost=True)
        newer = []
        for entry in reversed(self._entries):  # a client keeping up asks for the newest few
            if entry[0] <= after:
                break
            newer.append(entry)
        chunks: list[tuple[int, str, ChunkHash]] = []
        changes: list[tuple[int, str, ChunkHash, str, bool]] = []
        committed: list[tuple[int, str, ChunkHash]] = []
        last = self.seq
        for seq, entry_model, entry_world, salt, chunk_hash, medium, stored in reversed(newer):
            if entry_model != model or entry_world != world_size:
                continue
            if (medium and not tiers) or (not medium and stored and not commits):
                continue
            if len(chunks) + len(changes) + len(committed) == limit:
                last = seq - 1
                break
            if medium:
                changes.append((seq, salt, chunk_hash, medium, stored))
            elif stored:
                committed.append((seq, salt, chunk_hash))
            else:
                chunks.append((seq, salt, chunk_hash))
        return FeedSlice(chunks, last, lost=False, tier_changes=changes, committed=committed)

    def answer(self, req: p.Lookup, reply: p.LookupResult) -> None:
        """Fills ``reply`` with the entries after ``req.evictions_after`` it asks for (at most
        :data:`~testbed.core.protocol.MAX_EVICTIONS_PER_REPLY`)."""
        assert req.evictions_after is not None
        found = self.since(
            req.evictions_after,
            req.model,
            req.world_size,
            p.MAX_EVICTIONS_PER_REPLY,
            tiers=req.tier_events,
            commits=req.commits,
        )
        reply.evicted = [p.EvictedChunk(salt, chunk, seq) for seq, salt, chunk in found.chunks]
        reply.committed = [p.EvictedChunk(salt, chunk, seq) for seq, salt, chunk in found.committed]
        reply.tier_changes = [
            p.TierChange(salt, chunk, seq, medium, stored)
            for seq, salt, chunk, medium, stored in found.tier_changes
        ]
        reply.eviction_seq = found.seq
        reply.evictions_lost = found.lost
