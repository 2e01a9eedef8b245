"""Which requests an engine's KV pool can serve at all: the same filter for every engine, the
oracle and the what-if analysis, so measured runs and their bounds count the same traffic."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, TypeVar


class ServableShape(Protocol):
    """What the filter reads of a request (a workload request or a block-trace request)."""

    @property
    def request_id(self) -> str: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def max_output_tokens(self) -> int: ...


R = TypeVar("R", bound=ServableShape)


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
