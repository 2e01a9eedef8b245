"""What the cache server holds, as the scheduler sees it: the lookup mirror.

Pure logic, no vLLM, no sockets. With ``kvtb.lookup_mirror`` the scheduler side answers a
lookup the mirror predicts to be a miss at once, in the same ``get_num_new_matched_tokens``
call (no round trip, no step's delay), and sends the server the lookup anyway, as a message
it does not wait for: the server matches, logs, spans and counts it as any lookup, takes no
locks (nothing will be loaded), and counts the answers the mirror got wrong (it held more).
A lookup the mirror predicts to hit goes to the server as before (one round trip): only the
server's answer and locks decide what is loaded, so a stale mirror can cost a recompute (a
wrong miss) or a round trip (a predicted hit the server no longer holds), never a wrong
byte. vLLM's offloading connector (its scheduler answers from a local manager) and the
KV-event indexes of llm-d's and Dynamo's routers keep such a view the same way.

Where it learns from, every source numbered by the server's feed (``server.eviction_feed``):

- the stores this engine planned (:meth:`LookupMirror.planned`): counted as held at once,
  before any worker copied a byte, so a lookup of a chunk whose store is in flight goes to
  the server, which waits for the store as before (``pending``);
- the workers' reports of each finished store (:meth:`LookupMirror.reported`, the reports
  vLLM's KV events use, :mod:`connector.kv_events`): a chunk every writing rank committed is
  held as of the feed's number at the commit, and so is one the store found already held;
  one a rank did not write for want of room (or a failed store) is not;
- the feed the lookup replies carry (:meth:`LookupMirror.changed`): L1's commits by any
  client (another engine of a fleet behind the same server) and its removals (evictions,
  drops). A removal numbered above a chunk's commit removes it; one at or below concerns an
  earlier copy;
- the changes of the server's tiers below L1 in the same feed
  (:meth:`LookupMirror.tier_changed`): a chunk a tier holds is a predicted hit (the server
  brings it up into L1 before the load);
- a server that lost the feed or restarted (:meth:`LookupMirror.forget_all`): nothing is
  known held any more (stores still planned stay: they will be asked about).

What it cannot see: chunks the server held before this engine's first lookup, chunks at peers
and in a store other servers write to (a run with ``p2p`` or a ``redis`` tier refuses the
mirror), and chunks committed by another engine that no reply has reported yet. Each of
those is a wrong miss, counted by the server (``mirror_wrong``). Memory is bounded: past
``max_chunks`` the oldest held chunk is forgotten (a miss, never a wrong byte).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from connector.kv_events import ChunkKey, ChunkReport
from testbed.core.keys import ChunkHash

DEFAULT_MAX_CHUNKS = 1 << 18


@dataclass(frozen=True)
class FeedEntry:
    """One numbered change of L1 from the server's feed."""

    seq: int
    cache_salt: str
    chunk_hash: ChunkHash
    stored: bool
    """True: committed; False: removed."""


@dataclass
class MirrorStats:
    """What the mirror did (the server counts what it got wrong)."""

    answered: int = 0
    """Lookups the mirror answered itself (predicted misses)."""
    asked: int = 0
    """Lookups it sent to the server to answer (predicted hits)."""
    forgotten: int = 0
    """Times the server's feed was lost (or the server restarted) and the mirror emptied."""


@dataclass
class LookupMirror:
    num_writers: int
    """KV ranks that write each chunk (every TP rank; one with MLA)."""
    max_chunks: int = DEFAULT_MAX_CHUNKS
    stats: MirrorStats = field(default_factory=MirrorStats)

    def __post_init__(self) -> None:
        if self.num_writers < 1 or self.max_chunks < 1:
            raise ValueError("num_writers and max_chunks must be positive")
        self._held: OrderedDict[ChunkKey, int] = OrderedDict()
        """Chunks held in L1, with the feed's number at their commit."""
        self._planned: OrderedDict[ChunkKey, dict[int, int]] = OrderedDict()
        """Stores this engine planned and not every writer reported: per reporting rank, the
        feed's number at its commit."""
        self._removed_at: OrderedDict[ChunkKey, int] = OrderedDict()
        """The latest removal number seen per chunk (orders the reports and the feed)."""
        self._below: OrderedDict[ChunkKey, set[str]] = OrderedDict()
        """Chunks the server's tiers below L1 hold, with the tiers (hit-source names)."""

    def __len__(self) -> int:
        """Chunks known held (planned stores not counted)."""
        return len(self._held)

    def predicted_hit(self, cache_salt: str, hashes: Sequence[ChunkHash]) -> int:
        """The leading chunks of ``hashes`` held or being stored: the hit to expect."""
        for index, chunk_hash in enumerate(hashes):
            key = (cache_salt, chunk_hash)
            if key not in self._held and key not in self._planned and key not in self._below:
                return index
        return len(hashes)

    def planned(self, cache_salt: str, hashes: Iterable[ChunkHash]) -> None:
        """This engine planned stores of these chunks (held, as far as lookups go, until the
        workers report)."""
        for chunk_hash in hashes:
            key = (cache_salt, chunk_hash)
            if key not in self._held and key not in self._planned:
                self._planned[key] = {}
                _bound(self._planned, self.max_chunks)

    def reported(self, reports: Iterable[ChunkReport]) -> None:
        """The workers' outcomes of finished stores (:func:`connector.kv_events.store_reports`)."""
        for report in reports:
            key = (report.cache_salt, report.chunk_hash)
            commits = self._planned.get(key)
            if commits is None:
                continue
            landed = report.written or report.held
            if not landed or self._removed_at.get(key, 0) > report.seq:
                del self._planned[key]  # no room, failed, or gone since
                continue
            commits[report.kv_rank] = report.seq
            if len(commits) >= self.num_writers:
                del self._planned[key]
                self._hold(key, max(commits.values()))

    def changed(self, entries: Iterable[FeedEntry]) -> None:
        """L1's commits and removals from the feed, in any order (applied by number)."""
        for entry in sorted(entries, key=lambda e: e.seq):
            key = (entry.cache_salt, entry.chunk_hash)
            if entry.stored:
                if self._removed_at.get(key, 0) <= entry.seq:
                    self._hold(key, entry.seq)
                continue
            self._removed_at[key] = max(entry.seq, self._removed_at.pop(key, 0))
            _bound(self._removed_at, self.max_chunks)
            commit = self._held.get(key)
            if commit is not None and entry.seq > commit:
                del self._held[key]
            commits = self._planned.get(key)
            if commits and any(entry.seq > seq for seq in commits.values()):
                del self._planned[key]

    def tier_changed(self, changes: Iterable[tuple[str, ChunkHash, str, bool]]) -> None:
        """The tiers below L1 committed (``stored``) or removed these chunks ``(cache salt,
        chunk hash, tier, stored)``, oldest first: a chunk a tier holds is a hit to ask about
        whatever L1 does (the server brings it up before the load)."""
        for salt, chunk_hash, tier, stored in changes:
            key = (salt, chunk_hash)
            tiers = self._below.get(key)
            if stored:
                if tiers is None:
                    tiers = self._below[key] = set()
                    _bound(self._below, self.max_chunks)
                tiers.add(tier)
            elif tiers is not None:
                tiers.discard(tier)
                if not tiers:
                    del self._below[key]

    def forget_all(self) -> None:
        """The server lost track (its feed overflowed for this client, or it restarted)."""
        self._held.clear()
        self._removed_at.clear()
        self._below.clear()
        self.stats.forgotten += 1

    def _hold(self, key: ChunkKey, seq: int) -> None:
        self._held[key] = max(seq, self._held.pop(key, 0))
        _bound(self._held, self.max_chunks)


def _bound(entries: OrderedDict[ChunkKey, Any], limit: int) -> None:
    while len(entries) > limit:
        entries.popitem(last=False)
