"""Which requests an engine can serve, and the engines' ``max_model_len`` for them (pure)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TypeVar

from testbed.workloads import RequestShape

R = TypeVar("R", bound=RequestShape)


def split_servable(
    requests: Iterable[R], block_size: int, engine_blocks: int | None
) -> tuple[list[R], list[str]]:
    """The requests an engine with ``engine_blocks`` KV blocks can serve, and the ids of those
    it never could (vLLM would stall on them). Every engine, the oracle included, gets the same
    servable requests, so that measured runs and their bounds count the same traffic. A pool
    sized from the workload (``None``) serves every request."""
    if engine_blocks is None:
        return list(requests), []
    servable: list[R] = []
    rejected: list[str] = []
    for request in requests:
        tokens = request.num_prompt_tokens + request.max_output_tokens
        if -(-tokens // block_size) <= engine_blocks - 1:  # block 0 is vLLM's null block
            servable.append(request)
        else:
            rejected.append(request.request_id)
    return servable, rejected


def max_model_len(requests: Sequence[RequestShape], block_size: int) -> int:
    """The engines' ``max_model_len``: the longest request, rounded up to whole blocks."""
    longest = max(r.num_prompt_tokens + r.max_output_tokens for r in requests) + 1
    return max(1024, -(-longest // block_size) * block_size)
