"""The oracle engine: cache hit bounds from prefix-hash arithmetic alone (no server, no vLLM).

Mirrors what the cache server does with one request, minus locks, bytes and time: its keys
are ``chunk_hashes(prompt, chunk_size)`` (complete chunks only; the partial tail is never
stored and never hits; with the request's LoRA adapter and multimodal inputs), and the cache
is :mod:`testbed.models.cache_sim`'s: its hit is the longest cached prefix of those keys, then
its keys are walked in order (touched or inserted, evicting as the policy says while the cache
holds ``capacity_chunks`` keys). Policies: every name of :data:`cache_sim.POLICIES` —
``infinite`` (never evicts: the upper bound on reuse for the workload and chunk size), the
server's (``lru``, its default, ``fifo``, ``lfu``) and ``belady`` (MIN).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from testbed.models.access_trace import AccessTrace, HashedRequest, hashed_trace
from testbed.models.cache_sim import INFINITE, check_policy, replay_flat
from testbed.models.cache_sim import POLICIES as SIMULATED

POLICIES: tuple[str, ...] = tuple(name for name in SIMULATED if name != INFINITE)
"""The policies the oracle simulates a capacity under (without one it is ``infinite``)."""


@dataclass(frozen=True)
class OracleResult:
    policy: str
    """A name of :data:`testbed.models.cache_sim.POLICIES`."""
    capacity_chunks: int | None
    """Most keys the cache holds (``None``: infinite)."""
    requests: int
    prompt_tokens: int
    """All prompt tokens, partial tail chunks included."""
    hit_tokens: int
    """Sum over requests of matched complete chunks x chunk_size."""
    token_hit_rate: float
    """``hit_tokens / prompt_tokens`` (0.0 for no requests)."""
    mean_request_hit_rate: float
    """Mean over requests of hit tokens / prompt tokens (0.0 for no requests)."""
    per_request_hit_tokens: list[int]
    evicted_chunks: int
    chunk_size: int
    peak_cached_chunks: int
    """Most keys held at any time (never above ``capacity_chunks``)."""


def simulate(
    requests: Iterable[HashedRequest],
    chunk_size: int,
    policy: str = INFINITE,
    capacity_chunks: int | None = None,
) -> OracleResult:
    """Replays ``requests`` in order through a ``policy`` cache of ``capacity_chunks`` keys.

    ``infinite`` takes no capacity; the others need one (>= 0; 0 caches nothing).
    """
    check_policy(policy, capacity_chunks)
    return simulate_keys(hashed_trace(requests, chunk_size), policy, capacity_chunks)


def simulate_keys(
    trace: AccessTrace, policy: str = INFINITE, capacity_chunks: int | None = None
) -> OracleResult:
    """:func:`simulate` over an already keyed workload (each request's first lookup)."""
    outcome = replay_flat(*trace.request_key_arrays(), policy, capacity_chunks)
    per_request_hit_tokens = [hit * trace.chunk_size for hit in outcome.hit_chunks]
    prompts = trace.prompt_tokens.tolist()
    prompt_tokens = sum(prompts)
    hit_tokens = sum(per_request_hit_tokens)
    rates = [hit / total for hit, total in zip(per_request_hit_tokens, prompts, strict=True)]
    return OracleResult(
        policy=policy,
        capacity_chunks=capacity_chunks,
        requests=trace.num_requests,
        prompt_tokens=prompt_tokens,
        hit_tokens=hit_tokens,
        token_hit_rate=hit_tokens / prompt_tokens if prompt_tokens else 0.0,
        mean_request_hit_rate=sum(rates) / len(rates) if rates else 0.0,
        per_request_hit_tokens=per_request_hit_tokens,
        evicted_chunks=outcome.evicted,
        chunk_size=trace.chunk_size,
        peak_cached_chunks=outcome.peak,
    )
