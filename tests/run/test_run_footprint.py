"""The machine check counts what the engine will hold (``testbed/footprint.py``).

A run that fits is never refused: ``--requests`` above a trace's length runs the whole trace,
and a block-key engine over a block-hash trace (the oracle on ``agentic:``) holds block ids
and chunk keys, no token. A run that does not fit is still refused before any work, exit 2
(``test_run_resilience.py`` checks the machine's other refusals).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from testbed.cli.kvtb import main as kvtb
from testbed.run import RunOptions, footprint
from testbed.run.prepare import prepare_run
from testbed.spec.runspec import RunSpec

SESSIONS = Path(__file__).resolve().parents[3] / "shared/data/kv-cache-tester"
COPIES = 30
"""The corpus of :func:`corpus`: the shipped sessions this many times over, each copy under
ids of its own."""


def mooncake_trace(path: Path, requests: int, blocks: int) -> Path:
    """``requests`` records of ``blocks`` 512-token blocks each (the last one partial)."""
    lines = [
        {"timestamp": 10 * n, "input_length": blocks * 512 - 100, "output_length": 4,
         "hash_ids": [1_000_000 * n + b for b in range(blocks)]}
        for n in range(requests)
    ]  # fmt: skip
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_requests_above_a_traces_length_run_the_whole_trace(tmp_path, capsys):
    # 40 requests of ~10,000 tokens: ten million of them would need ~4.8 PB as tokens.
    trace = mooncake_trace(tmp_path / "trace.jsonl", requests=40, blocks=20)
    out = tmp_path / "runs"
    workload = ["--workload", f"mooncake:{trace}", "--requests", "10000000"]
    code = kvtb(["run", "--engine", "oracle", *workload, "--out", str(out), "--no-progress"])
    assert code == 0, capsys.readouterr().err
    (summary,) = out.glob("*/summary.json")
    assert json.loads(summary.read_text())["requests"] == 40
    # An engine that makes tokens is planned with the whole trace too, not refused.
    spec = RunSpec(engine="replay", workload=f"mooncake:{trace}", requests=10_000_000)
    plan = prepare_run(spec, RunOptions(progress=False), tmp_path / "elsewhere")
    assert len(plan.requests) == 40 and plan.requests[0].num_prompt_tokens == 20 * 512 - 100


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """The shipped kv-cache-tester sessions :data:`COPIES` times over: each copy of a file
    under a name of its own, so its block ids are its own (ids are scoped to the file)."""
    if not SESSIONS.is_dir():
        pytest.skip("no kv-cache-tester traces in ../shared/data")
    directory = tmp_path_factory.mktemp("corpus")
    for copy in range(COPIES):
        for session in sorted(SESSIONS.glob("*.json")):
            (directory / f"{session.stem}-copy{copy:02d}.json").symlink_to(session)
    return directory


@pytest.mark.slow
def test_the_block_key_oracle_over_thirty_times_the_agentic_sessions_is_not_refused(
    tmp_path, corpus
):
    spec = RunSpec(
        engine="oracle", workload=f"agentic:{corpus}", requests=None, engine_blocks=16384
    )
    plan = prepare_run(spec, RunOptions(progress=False), tmp_path / "runs")
    assert plan.blocks is not None and not plan.requests  # no token made
    blocks = plan.blocks
    assert len(blocks) > 40_000 and len({r.group.split("/")[0] for r in blocks}) == 23 * COPIES
    tokens = sum(r.num_prompt_tokens for r in blocks)
    assert tokens > 3_000_000_000
    # What it holds, estimated as keys, fits; the same requests as tokens would not.
    held = sum(footprint.key_bytes(r, spec.chunk_size) for r in blocks)
    available = footprint.available_memory_bytes()
    assert available is not None and held < available < tokens * footprint.WORKLOAD_BYTES_PER_TOKEN
    with pytest.raises(ValueError, match="does not fit on this machine"):
        footprint.check_run(spec, blocks, 1, own_server=False, out_dir=tmp_path)  # as tokens
    assert not (tmp_path / "runs").exists()
