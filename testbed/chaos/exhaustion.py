"""Scenarios where the machine runs out: shared memory, and disk.

Runs in the chaos process. Exhausted file systems are made in private mount namespaces
(``testbed.chaos.mounts``), never on the machine's own; where those cannot be made the
scenario is reported skipped. ``shm_exhaustion``: a server whose pool fits a small
``/dev/shm`` keeps every page when another process fills it (a client stores and reads back
through the pool, every byte checked, and nobody dies of ``SIGBUS``), and a server whose pool
no longer fits is refused at start, naming its size and what is free. ``disk_full``: a server
whose span and chunk log directory is full from the start serves a whole replay, counts and
logs what it could not write, and stops cleanly; the full run also fills the disk under a
run's own directory mid-run, and the run must end with a summary that says what is missing.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

from testbed.chaos import mounts
from testbed.chaos.lab import CHUNK_SIZE, Lab
from testbed.chaos.mounts import Tmpfs
from testbed.chaos.report import ScenarioResult
from testbed.chaos.shm_probe import CHUNKS_PER_CYCLE
from testbed.core import protocol as p
from testbed.core.append_file import PENDING_BYTES_ENV
from testbed.core.rpc import RpcClient

SHM = Path("/dev/shm")
_RUN_TIMEOUT_S = 300.0


def shm_exhaustion(lab: Lab) -> ScenarioResult:
    pool_mib, shm_mib, chunks = (24, 40, 2048) if lab.config.quick else (96, 128, 8192)
    result = lab.result(
        f"a server whose {pool_mib} MiB pool fits a {shm_mib} MiB /dev/shm keeps every page when "
        f"another process fills /dev/shm ({chunks} chunks stored and read back, no SIGBUS); a "
        "server whose pool no longer fits is refused at start, naming its size and what is free",
    )
    if _skipped(result):
        return result
    probe = ["-m", "testbed.chaos.shm_probe", "--pool-mib", str(pool_mib), "--chunks", str(chunks)]
    done = mounts.run_python([Tmpfs(SHM, shm_mib << 20)], *probe, timeout_s=_RUN_TIMEOUT_S)
    asked = -(-chunks // CHUNKS_PER_CYCLE) * 5
    result.set(sigbus_deaths=int(done.returncode == -signal.SIGBUS))
    result.add(requests_total=asked)
    outcome = _last_json(done.stdout) if done.returncode == 0 else None
    if outcome is None:
        result.add(requests_completed=0)
        result.details["probe"] = f"exit code {done.returncode}: {done.stderr[-1500:]}"
        return result
    refusal = outcome["refusal"]
    refused = refusal["exit_code"] == 2 and "cannot reserve" in refusal["message"]
    result.add(requests_completed=outcome["requests"], integrity_errors=outcome["errors"])
    result.set(pool_refusals=int(refused))
    result.checks["every chunk stored and read back after /dev/shm was filled"] = (
        outcome["errors"] == 0 and outcome["stored_bytes"] == chunks * CHUNK_SIZE * 128
    )
    result.checks["a pool that no longer fits is refused (exit 2, size and free named)"] = (
        refused and "free" in refusal["message"]
    )
    result.details.update(stored_bytes=outcome["stored_bytes"], refusal=refusal)
    return result


def disk_full(lab: Lab) -> ScenarioResult:
    n = lab.config.run_requests
    result = lab.result(
        f"a server whose span and chunk log directory is full serves a {n}-request replay, "
        "counts and logs (once) what it could not write, and stops cleanly"
        + (
            "; a run whose own disk fills mid-run ends with a summary saying what is missing"
            if not lab.config.quick
            else ""
        ),  # fmt: skip
    )
    if _skipped(result):
        return result
    run_dir = lab.dir / "server-run"
    run_dir.mkdir(exist_ok=True)
    server = lab.server(
        "--chunk-size", str(CHUNK_SIZE),
        "--capacity", "64MiB",
        "--run-dir", str(run_dir),
        "--token-file", str(lab.dir / "tokens.json"),  # readable outside its namespace
        wrapper=mounts.wrapper([Tmpfs(run_dir, 1 << 20, full=True)]),
    )  # fmt: skip
    child = lab.run(lab.spec("docqa", n), server, "run")
    child.wait(_RUN_TIMEOUT_S)
    summary = lab.record_run(result, child)
    with RpcClient(server.url, role="chaos", token=server.token, timeout_s=2.0) as client:
        stats = client.call(p.GetStats())
        assert isinstance(stats, p.ServerStats)
    not_written = stats.chunk_events_dropped + stats.chunk_events_pending
    result.set(chunk_events_dropped=not_written)
    lab.stop(server)
    log = (lab.dir / "server-0.log").read_text()
    result.checks["the server served the whole run"] = (
        summary is not None and summary.get("store_failures") == 0
    )
    result.checks["it counted the chunk log rows it could not write"] = not_written > 0
    result.checks["it logged each kind of loss once"] = (
        log.count("cannot write chunk log rows") == 1 and log.count("cannot write spans") == 1
    )
    result.checks["it stopped cleanly (exit code 0)"] = server.process is not None and (
        server.process.returncode == 0
    )
    if not lab.config.quick:
        _full_run_dir(lab, result)
    return result


def _full_run_dir(lab: Lab, result: ScenarioResult) -> None:
    """A run whose own disk fills after 3 of its requests (nothing kept in memory, so that
    what cannot be written is lost and must be reported)."""
    out = lab.dir / "full-run"
    out.mkdir(exist_ok=True)
    requests = lab.config.run_requests
    run = ["-m", "testbed.chaos.full_disk_run", str(out), "--requests", str(requests)]
    done = mounts.run_python(
        [Tmpfs(out, 16 << 20)], *run, timeout_s=_RUN_TIMEOUT_S, env={PENDING_BYTES_ENV: "0"}
    )
    summary = _last_json(done.stdout) if done.returncode == 0 else None
    result.add(requests_total=requests)
    if summary is None:
        result.details["full_run"] = f"exit code {done.returncode}: {done.stderr[-1500:]}"
        result.checks["a run whose disk filled wrote its summary"] = False
        return
    result.add(
        requests_completed=int(summary["requests_served"]),
        integrity_errors=int(summary.get("integrity_errors") or 0),
    )
    result.add(spans_dropped=int(summary["spans_dropped"]))
    result.checks["a run whose disk filled wrote its summary"] = True
    result.checks["its summary says what is missing"] = bool(summary["missing"]) and (
        summary["spans_dropped"] > 0
    )
    result.details["full_run_missing"] = summary["missing"]


def _skipped(result: ScenarioResult) -> bool:
    reason = mounts.unavailable()
    if reason is not None:
        result.skipped = reason
    return reason is not None


def _last_json(stdout: str) -> dict[str, Any] | None:
    lines = stdout.strip().splitlines()
    try:
        value = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None
