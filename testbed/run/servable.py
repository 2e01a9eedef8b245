"""The engines' ``max_model_len`` for a run's requests (pure); which requests an engine can serve
at all is :func:`testbed.models.servable.split_servable`."""

from __future__ import annotations

from collections.abc import Sequence

from testbed.models.servable import split_servable
from testbed.workloads import RequestShape

__all__ = ["max_model_len", "split_servable"]


def max_model_len(requests: Sequence[RequestShape], block_size: int) -> int:
    """The engines' ``max_model_len``: the longest request, rounded up to whole blocks."""
    longest = max(r.num_prompt_tokens + r.max_output_tokens for r in requests) + 1
    return max(1024, -(-longest // block_size) * block_size)
