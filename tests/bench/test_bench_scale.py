"""``kvtb bench --only scale``: its quick size runs every workload and reports every figure;
the peak memory counts the processes a command starts in sessions of their own. No speed or
size is asserted of the runs (the figures of a test run mean nothing)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from testbed.bench.peak_memory import TreePeak, tree_rss_bytes
from testbed.core.process_groups import start_group, stop_group

SCALE_KEYS = (
    "scale_1m_wall_s",
    "scale_1m_peak_rss_bytes",
    "scale_fleet16_wall_s",
    "scale_agentic_whatif_wall_s",
    "scale_agentic_peak_rss_bytes",
)

_HOLDS = 256 * 2**20
_GRANDCHILD = (
    "import subprocess, sys; "
    "child = subprocess.Popen([sys.executable, '-c', "
    f'\'import sys, time; b = bytearray({_HOLDS}); b[::4096] = b"x" * len(b[::4096]); '
    "print(1, flush=True); time.sleep(60)'], stdout=subprocess.PIPE, start_new_session=True); "
    "child.stdout.readline(); print(2, flush=True); child.wait()"
)


def test_the_peak_counts_a_descendant_in_a_session_of_its_own():
    process = start_group([sys.executable, "-c", _GRANDCHILD], stdout=subprocess.PIPE, text=True)
    try:
        with TreePeak(process.pid) as peak:
            assert process.stdout is not None and process.stdout.readline().strip() == "2"
            now = tree_rss_bytes(process.pid)
        assert now >= _HOLDS and peak.peak_bytes >= _HOLDS
        assert tree_rss_bytes(2**22 + 12345) == 0  # no such process
    finally:
        grandchildren = _children(process.pid)
        stop_group(process, 10.0)
        for pid in grandchildren:
            _kill(pid)


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as listing:
            return [int(p) for p in listing.read().split()]
    except OSError:
        return []


def _kill(pid: int) -> None:
    import contextlib
    import os
    import signal

    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


@pytest.mark.vllm
@pytest.mark.slow
def test_the_quick_scale_section_reports_every_figure(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "testbed.cli", "bench", "--quick", "--only", "scale",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads((tmp_path / "results.json").read_text())
    for key in SCALE_KEYS:
        assert doc[key]["value"] is not None and doc[key]["value"] > 0, key
        assert "quick" in doc[key]["note"], key
    assert doc["scale_1m_wall_s"]["what"].startswith("metadata-only replay: 200 requests")
    assert "oracle_wall_s" in doc["scale_agentic_whatif_wall_s"]["details"]
    oracle = json.loads(next((tmp_path / "work" / "scale" / "agentic-oracle").rglob(
        "summary.json")).read_text())  # fmt: skip
    assert oracle["requests"] > 0
    assert "Scale: wall time" in (tmp_path / "BENCHMARKS.md").read_text()
