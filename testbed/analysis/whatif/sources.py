"""Access traces from a workload, keyed exactly as the oracle keys it.

An oracle run (``kvtb run --engine oracle``) sees ``make_workload(spec.workload, ...,
vocab_size=32000)`` filtered by ``split_servable``. :func:`workload_traces` builds the same
requests and either

- hashes their tokens with the oracle's own :class:`~testbed.models.oracle.KeyTrace` (every
  generated workload), once at the greatest common divisor of the chunk sizes asked for, then
  re-chunks (keys are prefix-chained, so that is exact); or
- for a block-hash trace (Mooncake, agentic), keys chunks from the trace's block ids without
  synthesising a token, as the oracle does (:mod:`testbed.workloads.block_keys`: the keys the
  synthesised tokens' chunk hashes would give). ``tests/analysis/whatif`` checks them against
  hashed tokens on the real Mooncake trace.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TypeVar

import numpy as np

from testbed.analysis.whatif.trace import AccessTrace, workload_trace
from testbed.models.oracle import KeyTrace
from testbed.runspec import RunSpec
from testbed.workloads import (
    BlockTraceWorkload,
    RequestShape,
    Workload,
    WorkloadRequest,
    make_workload,
)
from testbed.workloads.block_keys import BlockKeys, ChunkKeys

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
        return {size: _trace(keyed.at(size), blocks) for size in sizes}
    requests = _servable(spec, workload)
    base = math.gcd(*sizes)
    keys = KeyTrace.from_requests(requests, base)
    offsets = np.zeros(len(keys.keys) + 1, dtype=np.int64)
    np.cumsum([len(k) for k in keys.keys], out=offsets[1:])
    flat = np.fromiter((k for ks in keys.keys for k in ks), dtype=np.int64, count=int(offsets[-1]))
    num_keys = int(flat.max()) + 1 if len(flat) else 0
    trace = _trace(ChunkKeys(base, flat, offsets, num_keys), requests)
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


def _trace(keys: ChunkKeys, requests: Sequence[RequestShape]) -> AccessTrace:
    """The oracle's access stream: per request, look up its chunks' keys, then walk them."""
    return workload_trace(
        keys.chunk_size,
        keys.keys,
        keys.offsets,
        num_keys=keys.num_keys,
        prompt_tokens=np.array([r.num_prompt_tokens for r in requests], dtype=np.int64),
        arrival_s=np.array([r.arrival_s for r in requests], dtype=np.float64),
        groups=np.array([r.group for r in requests], dtype=object),
    )
