"""What a run resolves from its requests before its engine starts (pure): vLLM's
``max_model_len``, and an engine's spec with it and the KV pool; which requests an engine can
serve at all is :func:`testbed.models.servable.split_servable`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from testbed.models.servable import split_servable
from testbed.run.footprint import pool_blocks
from testbed.spec.runspec import RunSpec
from testbed.workloads import RequestShape

if TYPE_CHECKING:
    from testbed.engine.engine_spec import EngineSpec

__all__ = ["engine_spec", "max_model_len", "split_servable"]

Spec = TypeVar("Spec", bound="EngineSpec")


def max_model_len(requests: Sequence[RequestShape], block_size: int) -> int:
    """The engines' ``max_model_len``: the longest request, rounded up to whole blocks."""
    longest = max(r.num_prompt_tokens + r.max_output_tokens for r in requests) + 1
    return max(1024, -(-longest // block_size) * block_size)


def engine_spec(
    kind: type[Spec], spec: RunSpec, requests: Sequence[RequestShape], **switches: Any
) -> Spec:
    """The spec of an engine (``kind``: its spec class) for a run of ``spec``: the run's spec
    itself, with vLLM's ``max_model_len`` (:func:`max_model_len`) and KV pool
    (``testbed.run.footprint.pool_blocks``) resolved from ``requests``; ``switches``: the
    engine's own fields."""
    return kind(
        run=spec,
        engine_blocks=pool_blocks(spec, requests),
        max_model_len=max_model_len(requests, spec.block_size),
        **switches,
    )
