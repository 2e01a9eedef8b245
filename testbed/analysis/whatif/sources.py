"""Access traces from a workload, keyed exactly as the oracle keys it.

An oracle run (``kvtb run --engine oracle``) sees ``make_workload(spec.workload, ...,
vocab_size=32000)`` filtered by ``split_servable``. :func:`workload_traces` builds the same
requests and either

- hashes their tokens as the oracle does (:func:`testbed.models.access_trace.hashed_trace`,
  every generated workload), once at the greatest common divisor of the chunk sizes asked for,
  then re-chunks (keys are prefix-chained, so that is exact); or
- for a block-hash trace (Mooncake, agentic), keys chunks from the trace's block ids without
  synthesising a token, as the oracle does (:mod:`testbed.workloads.block_keys`: the keys the
  synthesised tokens' chunk hashes would give). ``tests/analysis/whatif`` checks them against
  hashed tokens on the real Mooncake trace.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TypeVar

from testbed.models.access_trace import AccessTrace, hashed_trace
from testbed.spec.runspec import RunSpec
from testbed.workloads import (
    BlockTraceWorkload,
    RequestShape,
    Workload,
    WorkloadRequest,
    make_workload,
)
from testbed.workloads.block_keys import BlockKeys

ORACLE_VOCAB = 32_000
"""The vocabulary ``testbed.run`` gives replay and oracle workloads (its ``REPLAY_VOCAB``)."""
R = TypeVar("R", bound=RequestShape)


def workload_traces(spec: RunSpec, chunk_sizes: Sequence[int]) -> dict[int, AccessTrace]:
    """One trace per chunk size over the requests an oracle run of ``spec`` would see."""
    sizes = sorted(set(chunk_sizes))
    if not sizes or min(sizes) < 1:
        raise ValueError(f"chunk sizes must be positive, got {list(chunk_sizes)}")
    workload = _workload(spec)
    if isinstance(workload, BlockTraceWorkload):
        blocks = _servable(spec, workload.block_requests())
        keyed = BlockKeys(blocks)
        return {size: keyed.at(size) for size in sizes}
    trace = hashed_trace(_servable(spec, workload), math.gcd(*sizes))
    return {size: trace.at_chunk_size(size) for size in sizes}


def servable_requests(spec: RunSpec) -> list[WorkloadRequest]:
    """The requests (with tokens) an oracle run of ``spec`` serves (``testbed.run``'s
    construction)."""
    return _servable(spec, _workload(spec))


def _workload(spec: RunSpec) -> Workload:
    return make_workload(
        spec.workload,
        num_requests=spec.requests,
        seed=spec.seed,
        vocab_size=ORACLE_VOCAB,
        max_output_tokens=spec.max_output_tokens,
        params=spec.workload_params,
    )


def _servable(spec: RunSpec, requests: Iterable[R]) -> list[R]:
    from testbed.models.servable import split_servable

    servable, _ = split_servable(requests, spec.block_size, spec.engine_blocks)
    if not servable:
        raise ValueError(f"no request of {spec.workload!r} fits the engine's KV pool")
    return servable
