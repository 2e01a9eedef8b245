"""Mooncake trace reader (``mooncake:PATH``): JSONL records replayed with synthetic tokens.

Each line is ``{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}``
(format: ``shared/data/README.md``). ``hash_ids[i]`` names the i-th 512-token block together
with everything before it, one namespace for the whole trace, and the last id names the
(usually partial) last block. Tokens, keys and the sharing they keep are those of every
block-hash trace (:mod:`testbed.workloads.block_trace`).

The file is streamed: a malformed line is reported (with its line number) when iteration
reaches it.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

from testbed.workloads.base import WorkloadOptions
from testbed.workloads.block_trace import (
    BlockRequest,
    BlockTraceWorkload,
    block_id_array,
    is_int,
    is_number,
)

BLOCK_TOKENS = 512
"""Tokens per Mooncake hash block (fixed by the trace format)."""


class MooncakeWorkload(BlockTraceWorkload):
    """Requests of a Mooncake JSONL trace, in file order.

    ``num_requests`` keeps the first N records (``None``: all). ``arrival_s`` is
    ``timestamp / 1000``. Output length is the trace's ``output_length`` capped by
    ``max_output_tokens``, and at least 1 (an engine always produces the first token). Request
    ids are ``"<file stem>-NNNNNN"`` (0-based record index); ``group`` is ``""`` (the trace
    has no conversation ids).
    """

    kind = "mooncake"

    def __init__(self, path: str | Path, options: WorkloadOptions) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ValueError(f"mooncake trace not found: {self.path}")
        self.name = f"mooncake:{path}"
        self.options = options

    @classmethod
    def open(
        cls, path: str, options: WorkloadOptions, params: Mapping[str, object] | None
    ) -> MooncakeWorkload:
        """The reader ``make_workload`` calls; Mooncake traces take no params."""
        if params:
            raise ValueError(f"mooncake traces take no params; got {', '.join(map(repr, params))}")
        return cls(path, options)

    def describe(self) -> dict[str, object]:
        return {
            "name": self.name,
            "kind": self.kind,
            "path": str(self.path),
            # The content, not the path, decides the requests: a run's spec names the file's bytes.
            "sha256": hashlib.sha256(self.path.read_bytes()).hexdigest(),
            "num_requests": self.options.num_requests,
            "seed": self.options.seed,
            "vocab_size": self.options.vocab_size,
            "max_output_tokens": self.options.max_output_tokens,
            "block_tokens": BLOCK_TOKENS,
        }

    def block_requests(self) -> Iterator[BlockRequest]:
        limit = self.options.num_requests
        stem = self.path.stem
        index = 0
        previous_ms = 0.0
        with self.path.open("rb") as lines:
            for line_number, line in enumerate(lines, start=1):
                if limit is not None and index >= limit:
                    return
                if not line.strip():
                    continue
                timestamp_ms, input_length, output_length, hash_ids = _parse(
                    line, self.path, line_number
                )
                if timestamp_ms < previous_ms:
                    raise ValueError(
                        f"{self.path}:{line_number}: timestamp {timestamp_ms} is earlier than the "
                        f"previous record's {previous_ms} (records must be in arrival order)"
                    )
                previous_ms = timestamp_ms
                yield BlockRequest(
                    request_id=f"{stem}-{index:06d}",
                    arrival_s=timestamp_ms / 1000.0,
                    group="",
                    num_prompt_tokens=input_length,
                    max_output_tokens=self.options.cap_output(output_length),
                    block_ids=hash_ids,
                    block_tokens=BLOCK_TOKENS,
                )
                index += 1


def _parse(line: bytes, path: Path, line_number: int) -> tuple[float, int, int, np.ndarray]:
    where = f"{path}:{line_number}"
    try:
        record = json.loads(line)
    except ValueError as error:
        raise ValueError(f"{where}: not a JSON object ({error})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: not a JSON object")
    missing = [
        key
        for key in ("timestamp", "input_length", "output_length", "hash_ids")
        if key not in record
    ]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)}")
    timestamp_ms = record["timestamp"]
    input_length = record["input_length"]
    output_length = record["output_length"]
    hash_ids = block_id_array(record["hash_ids"])
    if not is_number(timestamp_ms) or not timestamp_ms >= 0 or not math.isfinite(timestamp_ms):
        raise ValueError(f"{where}: timestamp must be a number >= 0, got {timestamp_ms!r}")
    if not is_int(input_length) or input_length < 1:
        raise ValueError(f"{where}: input_length must be an integer >= 1, got {input_length!r}")
    if not is_int(output_length) or output_length < 0:
        raise ValueError(f"{where}: output_length must be an integer >= 0, got {output_length!r}")
    if hash_ids is None:
        raise ValueError(f"{where}: hash_ids must be a list of integers >= 0")
    expected = math.ceil(input_length / BLOCK_TOKENS)
    if len(hash_ids) != expected:
        raise ValueError(
            f"{where}: {len(hash_ids)} hash_ids for input_length {input_length}; expected "
            f"ceil({input_length}/{BLOCK_TOKENS}) = {expected}"
        )
    return float(timestamp_ms), input_length, output_length, hash_ids
