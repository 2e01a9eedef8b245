"""Scenarios that kill the cache server under a running engine.

Runs in the chaos process. ``server_kill``: a run's own server is SIGKILLed mid-replay and
never comes back; the run must still serve every request (as misses), write
``summary.json`` and ``metrics.parquet``, and count what failed. ``server_restart``: an
external server (fixed port and token file) is SIGKILLed mid-replay and restarted at once;
the engine must notice the new instance (epoch), register again and map the new pool, and a
second run reading what was stored must find every byte right. ``recovery_s`` is the time
from the restart to the first lookup the new instance answers with a hit (its chunk log).
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

from testbed.chaos.lab import CHUNK_SIZE, Lab
from testbed.chaos.probes import ProbeClient
from testbed.chaos.report import ScenarioResult
from testbed.chaos.runs import RunChild
from testbed.core.run_dir import RunDir

_RUN_TIMEOUT_S = 300.0
_DEAD_S = 0.3
_WORKLOAD = "docqa"
"""Documents that vLLM's small pool forgets and the cache serves: stores *and* retrieves."""


def server_kill(lab: Lab) -> ScenarioResult:
    result = lab.result(
        "a run whose own server is SIGKILLed mid-replay (no restart) still serves every request "
        "as misses, writes summary.json and metrics.parquet, counts the failed stores/retrieves "
        "and the outage, and no step waits past the connector timeout",
    )
    n = lab.config.run_requests
    child = lab.run(lab.spec(_WORKLOAD, n), None, "run")
    killed = _kill_server_midway(lab, child, n)
    child.wait(_RUN_TIMEOUT_S)
    summary = lab.record_run(result, child)
    run_dir = child.run.run_dir
    result.checks["server killed mid-run"] = killed is not None
    result.checks["summary.json and metrics.parquet written"] = (
        summary is not None and RunDir(run_dir).metrics.is_file()
    )
    if summary is not None:
        failed = (summary.get("store_failures") or 0) + (summary.get("retrieve_failures") or 0)
        result.checks["failed stores/retrieves counted"] = failed > 0
        result.checks["server_outage_s > 0"] = (summary.get("server_outage_s") or 0) > 0
        result.checks["server marked unavailable after"] = (
            summary.get("server_available_after") is False
        )
        result.details.update(_summary_facts(summary))
    # The next server start on this machine reclaims the dead server's pool and token file.
    lab.server("--chunk-size", str(CHUNK_SIZE), "--capacity", "1MiB")
    return result


def server_restart(lab: Lab) -> ScenarioResult:
    result = lab.result(
        "an external server SIGKILLed mid-replay and restarted on its port and token file: the "
        "run finishes, its workers remap the new pool (no write into the dead one), and a "
        "second run reading what was stored gets hits with 0 integrity errors",
    )
    port = _free_port()
    token_file = lab.dir / "tokens.json"
    log_dir = lab.dir / "server-run"
    args = [
        "--port", str(port),
        "--token-file", str(token_file),
        "--chunk-size", str(CHUNK_SIZE),
        "--capacity", "64MiB",
        "--run-dir", str(log_dir),
    ]  # fmt: skip
    first = lab.server(*args)
    n = lab.config.run_requests
    spec = lab.spec(_WORKLOAD, n)
    child = lab.run(spec, first, "first")
    restarted_ns = None
    second_server = None
    if child.wait_for(max(1, n * 3 // 10), _RUN_TIMEOUT_S):
        lab.kill(first.pid)
        time.sleep(_DEAD_S)  # the engine sends to the dead server
        # A supervisor restarts a server in seconds, while a real engine serves on for hours;
        # this run is short, so it pauses while the server restarts (its requests in flight
        # then time out, and what it does next straddles the restart).
        os.kill(child.pid, signal.SIGSTOP)
        try:
            restarted_ns = time.time_ns()
            second_server = lab.server(*args)
        finally:
            os.kill(child.pid, signal.SIGCONT)
    child.wait(_RUN_TIMEOUT_S)
    first_summary = lab.record_run(result, child)
    result.checks["server killed and restarted mid-run"] = second_server is not None
    if second_server is not None:
        with ProbeClient(second_server.url, second_server.token) as probe:
            stored = probe.stats().stored_bytes
        result.details["stored_after_restart_bytes"] = stored
        result.checks["the run stored into the restarted server"] = stored > 0
        result.checks["same credentials after restart"] = second_server.token == first.token
        second = lab.run(spec, second_server, "second")
        second.wait(_RUN_TIMEOUT_S)
        second_summary = lab.record_run(result, second)
        hits = (second_summary or {}).get("external_hit_tokens") or 0
        result.checks["second run hits what was stored"] = hits > 0
        result.details["second_run"] = _summary_facts(second_summary or {})
        lab.stop(second_server)  # flushes the chunk log
        assert restarted_ns is not None
        recovery = _first_hit_after(log_dir, second_server.pid, restarted_ns)
        result.set(recovery_s=recovery)
        result.checks["a hit after the restart"] = recovery is not None
    if first_summary is not None:
        result.details["first_run"] = _summary_facts(first_summary)
    return result


def _kill_server_midway(lab: Lab, child: RunChild, n: int) -> int | None:
    if not child.wait_for(max(1, n * 3 // 10), _RUN_TIMEOUT_S):
        return None
    pids = child.server_pids()
    if not pids:
        return None
    lab.kill(pids[0])
    return pids[0]


def _summary_facts(summary: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "requests",
        "requests_rejected",
        "integrity_errors",
        "external_hit_tokens",
        "store_failures",
        "retrieve_failures",
        "server_outage_s",
        "server_available_after",
        "server_quiescent",
        "server_state_after",
        "max_step_stall_s",
        "load_failed_tokens",
    )
    return {key: summary.get(key) for key in keys}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _first_hit_after(run_dir: Path, pid: int, since_ns: int) -> float | None:
    """Seconds from ``since_ns`` to the first lookup row with a hit in server ``pid``'s
    chunk log (``None``: no hit)."""
    from testbed.analysis.chunklog import has_chunk_log, load_chunk_log

    if not has_chunk_log(run_dir):
        return None
    log = load_chunk_log(run_dir)
    hits = log[
        (log["server"].astype(str) == f"server-{pid}")
        & (log["event"].astype(str) == "lookup")
        & (log["status"].astype(str) == "hit")
    ]
    if hits.empty:
        return None
    return (int(hits["time_ns"].min()) - since_ns) / 1e9
