"""What the fleet's caches hold, kept from vLLM's KV events (as llm-d's KV-cache indexer and
Dynamo's KV router keep it), for the ``kv_precise`` router.

vLLM's scheduler publishes, per instance, ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared`` events of its own prefix cache (``medium`` ``"GPU"``, whatever the device)
together with the events its KV connector emits (``take_events()``) about the external cache,
under another ``medium`` naming it. One index answers both halves:

- **engine**: per instance, the blocks its prefix cache holds (counted: vLLM may hold two
  copies of one block, each stored and removed on its own);
- **external**: per cache server, the blocks it holds (set-like); an event from any instance
  about the external medium updates the server that instance uses, so instances sharing one
  server share what it holds.

Pure: the vLLM event types are read in :mod:`testbed.fleet.kv_events`.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

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


class KVEventIndex:
    """The fleet's caches as their events describe them; ``server_of[i]`` is the cache server
    instance ``i`` uses (all 0 for one shared server)."""

    def __init__(self, server_of: Sequence[int]) -> None:
        self.server_of = list(server_of)
        self.engine = BlockLocations(len(self.server_of), counted=True)
        self.external = BlockLocations(max(self.server_of) + 1)
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
        of :attr:`engine`, or the slot of :attr:`external` of the server it uses."""
        if medium in ENGINE_MEDIA:
            return self.engine, instance
        return self.external, self.server_of[instance]

    def cleared(self, instance: int) -> None:
        """vLLM reset the instance's prefix cache (``AllBlocksCleared``)."""
        self.num_events += 1
        self.engine.clear(instance)

    def prefix(self, block_hashes: Sequence[Hashable]) -> PrefixView:
        engine = self.engine.prefix_blocks(block_hashes)
        by_server = self.external.prefix_blocks(block_hashes)
        return PrefixView(engine, [by_server[server] for server in self.server_of])
