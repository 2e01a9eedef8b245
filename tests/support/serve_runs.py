"""Serve-engine runs of a small Mooncake-format trace written for the test."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from testbed.spec.runspec import RunSpec

CROSSED_TURNS: list[dict[str, Any]] = [
    {"timestamp": 0, "input_length": 1000, "output_length": 4, "hash_ids": [1, 2]},
    {"timestamp": 0, "input_length": 1000, "output_length": 4, "hash_ids": [7, 8]},
    {"timestamp": 8000, "input_length": 1400, "output_length": 4, "hash_ids": [7, 8, 9]},
    {"timestamp": 8500, "input_length": 1400, "output_length": 4, "hash_ids": [1, 2, 3]},
]
"""Two conversations a and b, two turns each (the second shares the first's 1,000 tokens), b's
second turn first: round robin over two servers sends both second turns to the server their
first turn did not go to."""


def serve_spec(trace: Path, lines: list[dict[str, Any]], **spec: Any) -> RunSpec:
    """A serve run of ``lines`` (trace records, written to ``trace``) on launched vLLM servers
    of the tiny model: 256-token chunks, vLLM's CPU block of 32 and a 128-block pool, unless
    ``spec`` says otherwise."""
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    defaults: dict[str, Any] = {"chunk_size": 256, "block_size": 32, "engine_blocks": 128}
    return RunSpec(engine="serve", workload=f"mooncake:{trace}", **{**defaults, **spec})
