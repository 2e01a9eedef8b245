"""Hit sources: which tier served a request's external hit, token by token, by one convention.

The cache server answers a lookup with ``hit_chunks_by_tier`` (hit-source name -> chunks of the
hit matched in that tier at match time: ``host`` for L1, ``disk``, ``remote``, ``p2p``): counts,
not positions. Everything that splits an external hit by tier (the connector's report to vLLM,
the token categories ``external_host`` ... ``external_p2p``, the what-if over tiers) lays the
hit's chunks out in :data:`HIT_SOURCES` order — L1's first, then each lower tier's — and credits
a token range by its overlap with that layout. In an inclusive LRU hierarchy that is how a hit
prefix is ordered (a chunk is referenced at least as recently as the chunk after it), and for
every hierarchy it keeps each tier's total exact whenever the whole hit is loaded.

Plain Python; runs in the scheduler process (connector) and in analysis.
"""

from __future__ import annotations

from collections.abc import Mapping

HIT_SOURCES = ("host", "disk", "remote", "p2p")
"""vLLM's hit-source names of the tiers, L1 first; the layout order of a hit's chunks."""
L1_SOURCE = "host"


def source_layout(
    hit_tokens_by_source: Mapping[str, int], hit_tokens: int
) -> list[tuple[str, int, int]]:
    """``(source, start, end)`` token ranges of a hit of ``hit_tokens`` tokens laid out in
    :data:`HIT_SOURCES` order. Tokens the mapping does not cover (a server without tiers
    answers none) are L1's: a hit is in L1 unless the server says otherwise."""
    unknown = sorted(set(hit_tokens_by_source) - set(HIT_SOURCES))
    if unknown:
        raise ValueError(f"unknown hit sources {unknown}; known: {', '.join(HIT_SOURCES)}")
    lower = sum(max(0, int(hit_tokens_by_source.get(s, 0))) for s in HIT_SOURCES[1:])
    sizes = {L1_SOURCE: max(0, hit_tokens - lower)}
    sizes |= {s: max(0, int(hit_tokens_by_source.get(s, 0))) for s in HIT_SOURCES[1:]}
    ranges, start = [], 0
    for source in HIT_SOURCES:
        end = start + sizes[source]
        ranges.append((source, start, end))
        start = end
    return ranges


def split_range(
    start: int, end: int, hit_tokens_by_source: Mapping[str, int], hit_tokens: int
) -> dict[str, int]:
    """Tokens of ``[start, end)`` per hit source (every source present, zeros included);
    tokens beyond the layout count as L1's."""
    counts = dict.fromkeys(HIT_SOURCES, 0)
    covered = 0
    for source, low, high in source_layout(hit_tokens_by_source, hit_tokens):
        overlap = max(0, min(end, high) - max(start, low))
        counts[source] += overlap
        covered += overlap
    counts[L1_SOURCE] += max(0, end - start) - covered
    return counts
