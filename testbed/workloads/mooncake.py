"""Mooncake trace reader (``mooncake:PATH``): JSONL records replayed with synthetic tokens.

Each line is ``{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}``
(format: ``shared/data/README.md``). ``hash_ids[i]`` names the i-th 512-token block together
with everything before it. No text is published, so each hash id gets one deterministic
pseudo-random block of 512 token ids, seeded by ``(workload seed, hash id)``; a prompt is its
blocks concatenated and cut to ``input_length``. Equal ids give equal tokens, so two prompts
share exactly as many leading tokens as their common id prefix covers, and every chunk size
that divides 512 (or is a multiple of it) keeps the trace's sharing structure.

The file is streamed: a malformed line is reported (with its line number) when iteration
reaches it.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from testbed.workloads.base import WorkloadOptions, WorkloadRequest

BLOCK_TOKENS = 512
"""Tokens per Mooncake hash block (fixed by the trace format)."""

DEFAULT_BLOCK_CACHE_BLOCKS = 16384
"""Synthesised blocks kept for reuse (16384 x 512 int32 = 32 MiB): shared prefixes (the
system prompt, earlier turns) are generated once, not once per request."""


class MooncakeWorkload:
    """Requests of a Mooncake JSONL trace, in file order.

    ``num_requests`` keeps the first N records (``None``: all). ``arrival_s`` is
    ``timestamp / 1000``. Output length is the trace's ``output_length`` capped by
    ``max_output_tokens``, and at least 1 (an engine always produces the first token). Request
    ids are ``"<file stem>-NNNNNN"`` (0-based record index); ``group`` is ``""`` (the trace
    has no conversation ids).
    """

    kind = "mooncake"

    def __init__(
        self,
        path: str | Path,
        options: WorkloadOptions,
        *,
        block_cache_blocks: int = DEFAULT_BLOCK_CACHE_BLOCKS,
    ) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ValueError(f"mooncake trace not found: {self.path}")
        if block_cache_blocks < 0:
            raise ValueError(f"block_cache_blocks must be >= 0, got {block_cache_blocks}")
        self.name = f"mooncake:{path}"
        self.options = options
        self.block_cache_blocks = block_cache_blocks

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

    def __iter__(self) -> Iterator[WorkloadRequest]:
        blocks = _BlockSource(self.options.seed, self.options.vocab_size, self.block_cache_blocks)
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
                yield WorkloadRequest(
                    request_id=f"{stem}-{index:06d}",
                    prompt_token_ids=blocks.prompt(hash_ids, input_length),
                    max_output_tokens=self.options.cap_output(output_length),
                    arrival_s=timestamp_ms / 1000.0,
                )
                index += 1


def _parse(line: bytes, path: Path, line_number: int) -> tuple[float, int, int, list[int]]:
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
    hash_ids = record["hash_ids"]
    if not _is_number(timestamp_ms) or not timestamp_ms >= 0 or not math.isfinite(timestamp_ms):
        raise ValueError(f"{where}: timestamp must be a number >= 0, got {timestamp_ms!r}")
    if not _is_int(input_length) or input_length < 1:
        raise ValueError(f"{where}: input_length must be an integer >= 1, got {input_length!r}")
    if not _is_int(output_length) or output_length < 0:
        raise ValueError(f"{where}: output_length must be an integer >= 0, got {output_length!r}")
    if not isinstance(hash_ids, list) or not all(_is_int(h) and h >= 0 for h in hash_ids):
        raise ValueError(f"{where}: hash_ids must be a list of integers >= 0")
    expected = math.ceil(input_length / BLOCK_TOKENS)
    if len(hash_ids) != expected:
        raise ValueError(
            f"{where}: {len(hash_ids)} hash_ids for input_length {input_length}; expected "
            f"ceil({input_length}/{BLOCK_TOKENS}) = {expected}"
        )
    return float(timestamp_ms), input_length, output_length, hash_ids


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class _BlockSource:
    """One 512-token block per hash id, with a bounded LRU of recently used blocks."""

    def __init__(self, seed: int, vocab_size: int, capacity_blocks: int) -> None:
        self.seed = seed
        self.vocab_size = vocab_size
        self.capacity_blocks = capacity_blocks
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()

    def block(self, hash_id: int) -> np.ndarray:
        block = self._cache.get(hash_id)
        if block is not None:
            self._cache.move_to_end(hash_id)
            return block
        rng = np.random.default_rng([self.seed, hash_id])
        block = rng.integers(0, self.vocab_size, BLOCK_TOKENS, dtype=np.int32)
        if self.capacity_blocks:
            self._cache[hash_id] = block
            if len(self._cache) > self.capacity_blocks:
                self._cache.popitem(last=False)
        return block

    def prompt(self, hash_ids: list[int], num_tokens: int) -> np.ndarray:
        tokens = np.empty(num_tokens, dtype=np.int32)
        for index, hash_id in enumerate(hash_ids):
            start = index * BLOCK_TOKENS
            end = min(start + BLOCK_TOKENS, num_tokens)
            tokens[start:end] = self.block(hash_id)[: end - start]
        return tokens
