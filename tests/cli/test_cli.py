"""``kvtb`` refuses bad input with a message that names the problem, before doing any work."""

from __future__ import annotations

import json
import subprocess
import sys


def kvtb(*args: str, cwd=None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "testbed.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
        cwd=cwd,
    )


def test_bad_flag_values_and_config_keys_are_refused(tmp_path):
    done = kvtb("run", "--chunk-size", "big", "--out", str(tmp_path))
    assert done.returncode == 2 and "--chunk-size expects an integer, got 'big'" in done.stderr
    config = tmp_path / "run.toml"
    config.write_text('workload = "chat"\nchunk_sise = 128\n')
    done = kvtb("run", "--config", str(config), "--out", str(tmp_path))
    assert done.returncode == 2
    assert "unknown key 'chunk_sise'" in done.stderr and "chunk_size" in done.stderr
    done = kvtb("run", "--engine", "replay", "--policy", "belady", "--out", str(tmp_path))
    assert done.returncode == 2
    assert "policy 'belady' is not available with engine replay" in done.stderr
    assert not any(tmp_path.glob("*/summary.json"))


def test_an_oracle_run_writes_a_complete_run_directory(tmp_path):
    done = kvtb("run", "--engine", "oracle", "--workload", "rag", "--requests", "30",
                "--out", str(tmp_path), "--no-progress")  # fmt: skip
    assert done.returncode == 0, done.stderr
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert {"spec.json", "env.json", "metrics.parquet", "summary.json"} <= {
        p.name for p in run_dir.iterdir()
    }
    assert "token hit rate" in done.stdout
    again = kvtb("run", "--engine", "oracle", "--workload", "rag", "--requests", "30",
                 "--out", str(tmp_path), "--no-progress")  # fmt: skip
    assert again.returncode == 0 and again.stdout == done.stdout  # the finished run is reused


def test_the_printed_summary_shows_the_requests_served_and_rejected(tmp_path):
    # A vLLM pool of 24 blocks of 64 tokens fits some turns of each chat, not the longer ones.
    done = kvtb("run", "--engine", "oracle", "--workload", "chat", "--requests", "30",
                "--engine-blocks", "24", "--out", str(tmp_path), "--no-progress")  # fmt: skip
    assert done.returncode == 0, done.stderr
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    summary = json.loads((run_dir / "summary.json").read_text())
    served, rejected = summary["requests"], summary["requests_rejected"]
    assert served + rejected == 30 and served > 0 and rejected > 0
    assert f"{served} served, {rejected} rejected (too long for vLLM's KV pool" in done.stdout
