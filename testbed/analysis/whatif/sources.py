"""Access traces from a workload, keyed exactly as the oracle keys it.

An oracle run (``kvtb run --engine oracle``) sees ``make_workload(spec.workload, ...,
vocab_size=32000)`` filtered by ``split_servable`` and keys each request by
``testbed.keys.chunk_hashes`` of its tokens. :func:`workload_traces` builds the same requests
and either

- hashes their tokens with the oracle's own :class:`~testbed.engine.oracle.KeyTrace` (every
  workload), once at the greatest common divisor of the chunk sizes asked for, then re-chunks
  (keys are prefix-chained, so that is exact); or
- for a Mooncake trace, keys chunks from the trace's ``hash_ids`` without synthesising a token:
  the workload gives each hash id one pseudo-random 512-token block, so two prompts' first
  ``e`` tokens are equal exactly when the ids of the blocks covering them are equal (a
  collision of random 512-token blocks aside). The chunk ending at token ``e`` is therefore
  named by (the prefix-chained id of block ``b = (e - 1) // 512``, ``e - 512 b``): equal for
  two requests exactly when their chunk hashes are equal. ``tests/analysis/whatif`` checks the
  equality against the oracle on the real trace.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from testbed.analysis.whatif.trace import AccessTrace, workload_trace
from testbed.engine.oracle import KeyTrace
from testbed.runspec import RunSpec
from testbed.workloads import BLOCK_TOKENS, WorkloadRequest, make_workload

ORACLE_VOCAB = 32_000
"""The vocabulary ``testbed.run`` gives replay and oracle workloads (its ``REPLAY_VOCAB``)."""


def workload_traces(spec: RunSpec, chunk_sizes: Sequence[int]) -> dict[int, AccessTrace]:
    """One trace per chunk size over the requests an oracle run of ``spec`` would see."""
    sizes = sorted(set(chunk_sizes))
    if not sizes or min(sizes) < 1:
        raise ValueError(f"chunk sizes must be positive, got {list(chunk_sizes)}")
    path = _mooncake_path(spec)
    if path is not None:
        blocks = MooncakeBlocks.read(path, spec)
        return {size: blocks.trace(size) for size in sizes}
    requests = servable_requests(spec)
    base = math.gcd(*sizes)
    trace = _hashed_trace(requests, base)
    return {size: trace.at_chunk_size(size) for size in sizes}


def servable_requests(spec: RunSpec) -> list[WorkloadRequest]:
    """The requests an oracle run of ``spec`` serves (``testbed.run``'s construction)."""
    from testbed.run import split_servable

    requests = list(
        make_workload(
            spec.workload,
            num_requests=spec.requests,
            seed=spec.seed,
            vocab_size=ORACLE_VOCAB,
            max_output_tokens=spec.max_output_tokens,
            params=spec.workload_params,
        )
    )
    servable, _ = split_servable(requests, spec.block_size, spec.engine_blocks)
    if not servable:
        raise ValueError(f"no request of {spec.workload!r} fits the engine's KV pool")
    return servable


def _hashed_trace(requests: list[WorkloadRequest], chunk_size: int) -> AccessTrace:
    keyed = KeyTrace.from_requests(requests, chunk_size)
    offsets = np.zeros(len(keyed.keys) + 1, dtype=np.int64)
    np.cumsum([len(keys) for keys in keyed.keys], out=offsets[1:])
    keys = np.fromiter(
        (key for request_keys in keyed.keys for key in request_keys),
        dtype=np.int64,
        count=int(offsets[-1]),
    )
    return workload_trace(
        chunk_size,
        keys,
        offsets,
        num_keys=int(keys.max()) + 1 if len(keys) else 0,
        prompt_tokens=np.asarray(keyed.prompt_tokens, dtype=np.int64),
        arrival_s=np.array([r.arrival_s for r in requests], dtype=np.float64),
        groups=np.array([r.group for r in requests], dtype=object),
    )


def _mooncake_path(spec: RunSpec) -> Path | None:
    prefix, colon, path = spec.workload.partition(":")
    return Path(path) if colon and prefix == "mooncake" else None


class MooncakeBlocks:
    """A Mooncake trace's servable records as prefix-chained block ids (no tokens)."""

    def __init__(
        self,
        block_ids: np.ndarray,
        block_offsets: np.ndarray,
        prompt_tokens: np.ndarray,
        arrival_s: np.ndarray,
    ) -> None:
        self.block_ids = block_ids
        """int64: per request, the dense id of each block's hash-id *prefix*, concatenated."""
        self.block_offsets = block_offsets
        self.prompt_tokens = prompt_tokens
        self.arrival_s = arrival_s

    @classmethod
    def read(cls, path: Path, spec: RunSpec) -> MooncakeBlocks:
        if not path.is_file():
            raise ValueError(f"mooncake trace not found: {path}")
        prefixes: dict[tuple[int, int], int] = {}
        block_ids: list[int] = []
        offsets = [0]
        prompt_tokens: list[int] = []
        arrival_s: list[float] = []
        records = 0
        previous_ms = 0.0
        with path.open("rb") as lines:
            for line_number, line in enumerate(lines, start=1):
                if spec.requests is not None and records >= spec.requests:
                    break
                if not line.strip():
                    continue
                records += 1
                record = json.loads(line)
                timestamp_ms = float(record["timestamp"])
                if timestamp_ms < previous_ms:
                    raise ValueError(
                        f"{path}:{line_number}: timestamp {timestamp_ms} is earlier than the "
                        f"previous record's {previous_ms} (records must be in arrival order)"
                    )
                previous_ms = timestamp_ms
                input_length = int(record["input_length"])
                hash_ids = record["hash_ids"]
                if len(hash_ids) != -(-input_length // BLOCK_TOKENS):
                    raise ValueError(
                        f"{path}:{line_number}: {len(hash_ids)} hash_ids for input_length "
                        f"{input_length}"
                    )
                output = max(1, int(record["output_length"]))
                if spec.max_output_tokens is not None:
                    output = max(1, min(output, spec.max_output_tokens))
                blocks = -(-(input_length + output) // spec.block_size)
                if spec.engine_blocks is not None and blocks > spec.engine_blocks - 1:
                    continue  # split_servable: no engine of a run could serve it
                parent = -1
                for hash_id in hash_ids:
                    parent = prefixes.setdefault((parent, int(hash_id)), len(prefixes))
                    block_ids.append(parent)
                offsets.append(len(block_ids))
                prompt_tokens.append(input_length)
                arrival_s.append(timestamp_ms / 1000.0)
        if not prompt_tokens:
            raise ValueError(f"no request of {spec.workload!r} fits the engine's KV pool")
        return cls(
            np.asarray(block_ids, dtype=np.int64),
            np.asarray(offsets, dtype=np.int64),
            np.asarray(prompt_tokens, dtype=np.int64),
            np.asarray(arrival_s, dtype=np.float64),
        )

    def trace(self, chunk_size: int) -> AccessTrace:
        """The oracle's access stream at ``chunk_size`` (any positive size)."""
        counts = self.prompt_tokens // chunk_size
        request_of_chunk = np.repeat(np.arange(len(counts)), counts)
        chunk_offsets = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=chunk_offsets[1:])
        index = np.arange(chunk_offsets[-1], dtype=np.int64) - chunk_offsets[request_of_chunk]
        end_token = (index + 1) * chunk_size
        block = (end_token - 1) // BLOCK_TOKENS
        within = end_token - block * BLOCK_TOKENS  # 1..512
        prefix_id = self.block_ids[self.block_offsets[request_of_chunk] + block]
        _, dense = np.unique(prefix_id * (BLOCK_TOKENS + 1) + within, return_inverse=True)
        dense = dense.astype(np.int64).reshape(-1)
        return workload_trace(
            chunk_size,
            dense,
            chunk_offsets,
            num_keys=int(dense.max()) + 1 if len(dense) else 0,
            prompt_tokens=self.prompt_tokens,
            arrival_s=self.arrival_s,
            groups=np.full(len(counts), "", dtype=object),
        )
