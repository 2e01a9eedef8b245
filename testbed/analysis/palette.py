"""One palette for where prompt tokens went, defined once.

Every figure and notebook that shows token categories (METRICS.md, "Where every prompt token
went") or the classes derived from them draws each in the colour given here, so that a colour
means the same thing in every figure: hits from vLLM's own prefix cache are blue, hits from the
external cache green, and each cause of a miss has its own colour; the sum of the misses,
``recomputed``, is light grey (no single cause), and a request class takes the colour of what
served it (:data:`SERVED_BY_COLOURS`).
"""

from __future__ import annotations

CATEGORY_COLOURS = {
    "engine": "tab:blue",
    "external": "tab:green",
    "cold": "tab:gray",
    "capacity": "tab:red",
    "partial_chunk": "tab:olive",
    "last_token": "black",
    "load_failed": "tab:purple",
    "in_flight": "tab:orange",
    "unavailable": "tab:brown",
    "refused": "tab:pink",
    "engine_only": "tab:cyan",
    "routing": "gold",
    "prefetch_timeout": "darkorange",
    "tier_read_failed": "maroon",
    "store_dropped": "salmon",
}
"""Colour of each token category (the keys of ``testbed.analysis.attribution.CATEGORIES``)."""
CATEGORY_LABELS = {
    "engine": "engine (vLLM prefix cache)",
    "external": "external (cache server)",
    "cold": "cold",
    "capacity": "capacity",
    "partial_chunk": "partial chunk",
    "last_token": "last token",
    "load_failed": "load failed",
    "in_flight": "in flight",
    "unavailable": "unavailable",
    "refused": "refused (server limit)",
    "engine_only": "engine only",
    "routing": "routing (held by another instance)",
    "prefetch_timeout": "prefetch timeout (late from a lower tier)",
    "tier_read_failed": "tier read failed",
    "store_dropped": "store dropped (back-pressure)",
}
"""Legend name of each token category."""
RECOMPUTED = "recomputed"
RECOMPUTED_COLOUR = "silver"
"""The misses together (every category but ``engine`` and ``external``)."""
SERVED_BY_COLOURS = {
    "external cache": CATEGORY_COLOURS["external"],
    "vLLM prefix cache only": CATEGORY_COLOURS["engine"],
    "no hit": RECOMPUTED_COLOUR,
}
"""A request by what served its hits (``testbed.analysis.per_request.SERVED_BY``)."""


def colour(name: str) -> str:
    """The colour of a category, of ``recomputed`` or of a request class."""
    if name == RECOMPUTED:
        return RECOMPUTED_COLOUR
    return CATEGORY_COLOURS.get(name) or SERVED_BY_COLOURS[name]
