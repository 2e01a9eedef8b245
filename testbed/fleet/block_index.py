"""Which holder holds which blocks: the index behind every prefix-aware routing decision.

A *holder* is a small integer (an instance's prefix cache, or a cache server); a *block hash*
is any hashable naming one block together with everything before it (vLLM's block hashes, as
its KV events carry them, are prefix-chained), so a request's cached prefix on a holder is the
number of its leading block hashes the holder holds.

Two kinds of holding:

- **counted** (``counted=True``): a holder may hold several copies of one block (vLLM does not
  de-duplicate blocks computed by two requests at once; each copy is stored and removed on
  its own), and holds the block while any copy is left;
- **set-like**: a store of a block it holds already changes nothing, a remove drops it (a cache
  server keeps one object per key).

``capacity_blocks`` bounds each holder's blocks, least recently added or touched first out:
an index that guesses what a holder keeps (the router's own, without events) forgets as the
holder's own pool would.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence


class BlockLocations:
    """Block hashes per holder (see the module docstring)."""

    def __init__(
        self, num_holders: int, *, counted: bool = False, capacity_blocks: int | None = None
    ) -> None:
        if num_holders < 1:
            raise ValueError(f"num_holders must be >= 1, got {num_holders}")
        if capacity_blocks is not None and capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.num_holders = num_holders
        self.counted = counted
        self.capacity_blocks = capacity_blocks
        self._copies: dict[Hashable, dict[int, int]] = {}
        self._recency: list[OrderedDict[Hashable, None]] = [
            OrderedDict() for _ in range(num_holders)
        ]

    def add(self, holder: int, block_hashes: Iterable[Hashable]) -> None:
        """``holder`` now holds (one more copy of) each of ``block_hashes``."""
        recency = self._recency[holder]
        for block_hash in block_hashes:
            copies = self._copies.setdefault(block_hash, {})
            copies[holder] = copies.get(holder, 0) + 1 if self.counted else 1
            recency[block_hash] = None
            recency.move_to_end(block_hash)
        if self.capacity_blocks is not None:
            while len(recency) > self.capacity_blocks:
                oldest, _ = recency.popitem(last=False)
                self._drop(holder, oldest)

    def remove(self, holder: int, block_hashes: Iterable[Hashable]) -> None:
        """``holder`` dropped (one copy of) each of ``block_hashes``; unknown ones are ignored
        (an event stream joined late, or an eviction of a block it never reported)."""
        for block_hash in block_hashes:
            copies = self._copies.get(block_hash)
            if copies is None or holder not in copies:
                continue
            if self.counted and copies[holder] > 1:
                copies[holder] -= 1
                continue
            self._recency[holder].pop(block_hash, None)
            self._drop(holder, block_hash)

    def clear(self, holder: int) -> None:
        """``holder`` holds nothing any more."""
        for block_hash in list(self._recency[holder]):
            self._drop(holder, block_hash)
        self._recency[holder].clear()

    def holds(self, holder: int, block_hash: Hashable) -> bool:
        return holder in self._copies.get(block_hash, ())

    def num_blocks(self, holder: int) -> int:
        return len(self._recency[holder])

    def prefix_blocks(self, block_hashes: Sequence[Hashable]) -> list[int]:
        """Per holder, how many leading blocks of ``block_hashes`` it holds (one walk over the
        request's blocks, stopping when no holder is left)."""
        held = [0] * self.num_holders
        matching = set(range(self.num_holders))
        for position, block_hash in enumerate(block_hashes):
            copies = self._copies.get(block_hash)
            still = matching & copies.keys() if copies else set()
            for holder in matching - still:
                held[holder] = position
            matching = still
            if not matching:
                return held
        for holder in matching:
            held[holder] = len(block_hashes)
        return held

    def touch(self, holder: int, block_hashes: Iterable[Hashable]) -> None:
        """Marks blocks ``holder`` holds as just used (their recency, for the capacity)."""
        recency = self._recency[holder]
        for block_hash in block_hashes:
            if block_hash in recency:
                recency.move_to_end(block_hash)

    def _drop(self, holder: int, block_hash: Hashable) -> None:
        copies = self._copies[block_hash]
        del copies[holder]
        if not copies:
            del self._copies[block_hash]
