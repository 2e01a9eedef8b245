"""Projected TTFT of a request whose hits came from several tiers.

One request alone, its prefill in one step (as :mod:`testbed.models.projections`): the GPU part
from the time model with nothing loaded, then the loads from the tier profile's links
(:mod:`testbed.models.links`): the server's prefetch of the lower-tier hits into L1, then every
hit over the L1 -> device link (overlapping the forward pass when the hardware profile says
``overlap_loads``). A hit served from disk costs its disk read on top of the host copy, so the
same hit rate projects a longer TTFT the more of it came from below L1.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from testbed.models.links import TierProfile
from testbed.models.time_model import RooflineTimeModel, TimeModel

HIT_SOURCES = ("host", "disk", "remote", "p2p")


def tiered_ttft_s(
    model: TimeModel,
    links: TierProfile,
    prompt_tokens: np.ndarray,
    hit_tokens_by_source: Mapping[str, np.ndarray],
    *,
    bytes_per_token: float,
    written_tokens: np.ndarray | float = 0.0,
) -> np.ndarray:
    """Per request: projected TTFT (s) with ``hit_tokens_by_source[s][r]`` of its prompt
    served by hit source ``s`` (vLLM's names), ``written_tokens`` going into the disk tier
    meanwhile. The hits together are clipped to ``P - 1`` (the engine computes the last
    prompt token), the lowest tier's first."""
    unknown = sorted(set(hit_tokens_by_source) - set(HIT_SOURCES))
    if unknown:
        raise ValueError(f"unknown hit sources {unknown}; choose from {', '.join(HIT_SOURCES)}")
    prompts = np.asarray(prompt_tokens, dtype=np.float64)
    hits = _clipped(prompts, hit_tokens_by_source)
    loaded = sum(hits.values(), np.zeros_like(prompts))
    gpu_s = model.isolated_s(prompts - loaded, loaded, np.zeros_like(prompts))
    moved = {source: tokens * bytes_per_token for source, tokens in hits.items()}
    written = np.asarray(written_tokens, dtype=np.float64) * bytes_per_token
    prefetch_s = links.prefetch_s({s: b for s, b in moved.items() if s != "host"}, written)
    device_s = links.transfer_s("l1_device", loaded * bytes_per_token)
    overlap = isinstance(model, RooflineTimeModel) and model.hardware.overlap_loads
    return prefetch_s + (np.maximum(gpu_s, device_s) if overlap else gpu_s + device_s)


def _clipped(prompts: np.ndarray, hits: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    room = np.maximum(prompts - 1, 0)
    result = {
        s: np.asarray(hits.get(s, 0.0), dtype=np.float64) * np.ones_like(prompts)
        for s in HIT_SOURCES
    }
    excess = np.maximum(sum(result.values(), np.zeros_like(prompts)) - room, 0)
    for source in reversed(HIT_SOURCES):  # the lowest tier's tokens are the prefix's tail
        cut = np.minimum(result[source], excess)
        result[source] = result[source] - cut
        excess = excess - cut
    return result
