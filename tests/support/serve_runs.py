"""Serve-engine runs of a small Mooncake-format trace written for the test."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from testbed.spec.runspec import RunSpec


def serve_spec(trace: Path, lines: list[dict[str, Any]], **spec: Any) -> RunSpec:
    """A serve run of ``lines`` (trace records, written to ``trace``) on launched vLLM servers
    of the tiny model: 256-token chunks, vLLM's CPU block of 32 and a 128-block pool, unless
    ``spec`` says otherwise."""
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    defaults: dict[str, Any] = {"chunk_size": 256, "block_size": 32, "engine_blocks": 128}
    return RunSpec(engine="serve", workload=f"mooncake:{trace}", **{**defaults, **spec})
