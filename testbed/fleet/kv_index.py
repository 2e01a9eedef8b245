"""What the fleet's caches hold, kept from vLLM's KV events (as llm-d's KV-cache indexer and
Dynamo's KV router keep it), for the ``kv_precise`` router.

vLLM's scheduler publishes, per instance, ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared`` events of its own prefix cache (``medium`` ``"GPU"``, whatever the device)
together with the events its KV connector emits (``take_events()``) about the external cache,
under another ``medium`` naming it. One index answers both halves:

- **engine**: per instance, the blocks its prefix cache holds (counted: vLLM may hold two
  copies of one block, each stored and removed on its own);
- **external**: per cache server, the blocks its L1 holds (set-like); an event from any
  instance about the external medium updates the server that instance uses, so instances
  sharing one server share what it holds;
- **lower**: per tier below a server's L1 (the connector's media ``kvtb/disk``,
  ``kvtb/remote``: ``connector.kv_events.tier_medium``), per cache server, the blocks the tier
  holds (set-like), so a router can credit a block by the tier that would load it.

Pure: the vLLM event types are read in :mod:`testbed.fleet.kv_events`.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from connector.kv_events import medium_tier
from testbed.fleet.block_index import BlockLocations

ENGINE_MEDIA = frozenset({"GPU", None})
"""``medium`` values of vLLM's own prefix cache (its block pool reports ``"GPU"`` on every
device); every other medium is the external cache the instance's connector talks to."""


@dataclass(frozen=True)
class PrefixView:
    """Per instance, the leading blocks of one request held by its prefix cache and by the
    cache server it uses (``external`` counts from the first block too)."""

    engine: list[int]
    external: list[int]
    lower: dict[str, list[int]] = field(default_factory=dict)
    """Per tier below L1 (its hit-source name: ``disk``, ``remote``), per instance, the
    leading blocks that tier of the instance's server holds."""
    peer: list[int] = field(default_factory=list)
    """Per instance, the most leading blocks the L1 of any other server holds (a peer)."""


class KVEventIndex:
    """The fleet's caches as their events describe them; ``server_of[i]`` is the cache server
    instance ``i`` uses (all 0 for one shared server)."""

    def __init__(self, server_of: Sequence[int]) -> None:
        self.server_of = list(server_of)
        self.engine = BlockLocations(len(self.server_of), counted=True)
        self.external = BlockLocations(max(self.server_of) + 1)
        self.lower: dict[str, BlockLocations] = {}
        self.num_events = 0

    def stored(self, instance: int, medium: str | None, block_hashes: Iterable[Hashable]) -> None:
        self.num_events += 1
        locations, slot = self._holder(instance, medium)
        locations.add(slot, block_hashes)

    def removed(self, instance: int, medium: str | None, block_hashes: Iterable[Hashable]) -> None:
        self.num_events += 1
        locations, slot = self._holder(instance, medium)
        locations.remove(slot, block_hashes)

    def _holder(self, instance: int, medium: str | None) -> tuple[BlockLocations, int]:
        """Where an event of ``instance`` about ``medium`` lands: its own prefix cache's slot
        of :attr:`engine`, or the slot of the server it uses in :attr:`external` (L1, and any
        medium not the connector's) or in the tier's :attr:`lower`."""
        if medium in ENGINE_MEDIA:
            return self.engine, instance
        tier = medium_tier(medium)
        if not tier:
            return self.external, self.server_of[instance]
        if tier not in self.lower:
            self.lower[tier] = BlockLocations(self.external.num_holders)
        return self.lower[tier], self.server_of[instance]

    def cleared(self, instance: int) -> None:
        """vLLM reset the instance's prefix cache (``AllBlocksCleared``)."""
        self.num_events += 1
        self.engine.clear(instance)

    def prefix(self, block_hashes: Sequence[Hashable]) -> PrefixView:
        engine = self.engine.prefix_blocks(block_hashes)
        by_server = self.external.prefix_blocks(block_hashes)
        lower = {
            tier: [held[server] for server in self.server_of]
            for tier, held in (
                (tier, locations.prefix_blocks(block_hashes))
                for tier, locations in self.lower.items()
            )
        }
        peer = [
            max((held for other, held in enumerate(by_server) if other != server), default=0)
            for server in self.server_of
        ]
        return PrefixView(engine, [by_server[server] for server in self.server_of], lower, peer)
