"""Scenarios where the remote tier (a real Redis) fails under a run or a slow network.

Runs in the chaos process. ``redis_restart``: an engine run on a server whose only tier below
L1 is a Redis the scenario started; the Redis is SIGKILLed a third of the way through the run
and started again (empty) a moment later. The run must end with its summary and every request
answered, 0 integrity errors; the server counts the writes and reads that failed while the
store was down (cause ``unavailable``), writes through to the restarted store again, and stops
cleanly. ``redis_slow_network`` (``testbed.chaos.netem_run``) runs in a private network
namespace whose loopback has a delay added with ``tc netem``.
"""

from __future__ import annotations

import functools
import itertools
import json
import subprocess
import sys
import time

from server.launch import ServerProcess
from server.tiers.redis_process import EmbeddedRedis, redis_server_path
from testbed.chaos import mounts, netem_run
from testbed.chaos.lab import CHUNK_SIZE, Lab
from testbed.chaos.probes import ProbeClient, chunk_hashes
from testbed.chaos.report import ScenarioResult
from testbed.chaos.tier_faults import read_back, tier_after
from testbed.core import protocol as p
from testbed.core.keys import ChunkHash
from testbed.core.rpc import RpcClient

_RUN_TIMEOUT_S = 300.0
_DOWN_S = 0.3
"""How long the store stays dead (the run's stores and loads meet it dead)."""
_WORKLOAD = "docqa"
_WRITE_S = 30.0
STORE_BYTES = 64 << 20
MISSING = (
    "needs redis-server (`apt-get install redis-server`) and the redis client "
    "(`pip install 'kvtestbed[redis]'`)"
)


def redis_unavailable() -> str | None:
    """Why the redis scenarios cannot run here, or ``None``."""
    import importlib.util

    if redis_server_path() is None or importlib.util.find_spec("redis") is None:
        return MISSING
    return None


def redis_restart(lab: Lab) -> ScenarioResult:
    result = lab.result(
        "an engine run on a server with a redis tier, the Redis SIGKILLed mid-run and started "
        "again (empty): the run ends with its summary and every request answered, 0 integrity "
        "errors, the failed tier operations counted with cause 'unavailable', writes through "
        "to the restarted store, and the server stops cleanly",
    )
    reason = redis_unavailable()
    if reason is not None:
        result.skipped = reason
        return result
    with EmbeddedRedis(lab.dir / "redis", STORE_BYTES) as store:
        server = lab.server(
            "--chunk-size", str(CHUNK_SIZE),
            "--capacity", "64MiB",
            "--tier", f"redis:{STORE_BYTES}:{store.url}",
        )  # fmt: skip
        n = lab.config.run_requests
        child = lab.run(lab.spec(_WORKLOAD, n), server, "run")
        down: p.TierStats | None = None
        if child.wait_for(max(1, n // 3), _RUN_TIMEOUT_S):
            store.kill()
            time.sleep(_DOWN_S)  # the run's writes through meet a dead store
            down = _tier(server.url, server.token)
            store.start()
        exit_code = child.wait(_RUN_TIMEOUT_S)
        summary = lab.record_run(result, child)
        after_run = _tier(server.url, server.token)
        _probe_store(lab, result, server, store)
        lab.stop(server)
    code = None if server.process is None else server.process.returncode
    unavailable = after_run.failures_by_cause.get("unavailable", 0)
    result.checks["the store killed and restarted mid-run"] = down is not None
    result.checks["the run ended with its summary and rc 0"] = (
        summary is not None and exit_code == 0
    )
    result.checks["the run's tier failures counted with cause 'unavailable'"] = unavailable > 0
    result.checks["the server stopped cleanly (exit 0)"] = code == 0
    result.details.update(
        run_writes=after_run.writes,
        run_failures_by_cause=after_run.failures_by_cause,
        external_hit_tokens=(summary or {}).get("external_hit_tokens"),
    )
    return result


def _probe_store(
    lab: Lab, result: ScenarioResult, server: ServerProcess, store: EmbeddedRedis
) -> None:
    """After the run: chunks written through to the restarted store hit with every byte right
    (only the store holds them); the store killed again, chunks only it held are counted
    misses (cause ``tier_read_failed``), never a wrong byte."""
    chunks = 8
    with ProbeClient(server.url, server.token, timeout_s=10.0) as probe:
        probe.register()
        again = _write_through(lab, server, probe, "again", chunks)
        hit, errors = read_back(probe, "again", again or [])
        lost = _write_through(lab, server, probe, "lost", chunks)
        before = probe.stats()
        store.kill()
        missed, wrong = read_back(probe, "lost", lost or [])
        stats = probe.stats()
    result.add(integrity_errors=errors + wrong)
    result.set(
        leaked_locks=stats.num_locks,
        leaked_pins=stats.num_pins,
        leaked_inflight=stats.num_inflight_stores + stats.num_inflight_retrieves,
    )
    failed = stats.tier_read_failures - before.tier_read_failures
    result.checks["writes through to the restarted store"] = again is not None and lost is not None
    result.checks["what the restarted store holds hits, every byte right"] = hit == chunks
    result.checks["the store killed again: counted tier_read_failed misses"] = (
        missed == 0 and failed >= 1
    )
    result.details.update(hit_after_restart=hit, tier_read_failures=failed)


def _write_through(
    lab: Lab, server: ServerProcess, probe: ProbeClient, label: str, chunks: int
) -> list[ChunkHash] | None:
    """Stores new chunks until a batch is written through whole (the store tries Redis again
    once its retry window has passed), then drops them from L1; ``None`` past the deadline."""
    deadline = time.monotonic() + _WRITE_S
    for attempt in itertools.count():
        before = probe.stats().tiers[0]
        settled = before.writes + before.failures + before.dropped_writes + chunks
        hashes = chunk_hashes(f"{lab.name}-{label}-{attempt}", chunks)
        probe.store(f"{label}-{attempt}", hashes)
        after = tier_after(probe, functools.partial(_settled_past, settled))
        if after.writes == before.writes + chunks:
            with RpcClient(server.url, role="chaos-admin", token=server.admin_token) as admin:
                admin.call(p.DropObjects(chunk_hashes=hashes))
            return hashes
        if time.monotonic() > deadline:
            return None
    return None


def _settled_past(count: int, tier: p.TierStats) -> bool:
    return tier.writes + tier.failures + tier.dropped_writes >= count


def _tier(url: str, token: str) -> p.TierStats:
    with ProbeClient(url, token) as probe:
        return probe.stats().tiers[0]


def redis_slow_network(lab: Lab) -> ScenarioResult:
    chunks = 8 if lab.config.quick else 32
    timeout_ms = netem_run.PREFETCH_TIMEOUT_S * 1e3
    result = lab.result(
        f"a server whose redis tier is over TCP on a slowed loopback (private network "
        f"namespace; {chunks} chunks, prefetch timeout {timeout_ms:.0f} ms): the first lookup "
        "misses with cause prefetch_timeout, counted, the chunks that arrive later hit with "
        "every byte right, and the server stops cleanly",
    )
    reason = redis_unavailable()
    shaped = netem_run.shape()
    if reason is not None or isinstance(shaped, str):
        result.skipped = reason or str(shaped)
        return result
    what, script = shaped
    done = subprocess.run(
        [*netem_run.wrapper(script), sys.executable, "-m", "testbed.chaos.netem_run",
         "--chunks", str(chunks)],
        capture_output=True, text=True, timeout=_RUN_TIMEOUT_S, cwd=mounts.REPO,
    )  # fmt: skip
    (lab.dir / "netem_run.log").write_text(done.stdout + done.stderr)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        result.error = f"netem_run exited {done.returncode}: {done.stderr.strip()[-500:]}"
        return result
    run = json.loads(lines[-1])
    result.add(
        requests_total=chunks,
        requests_completed=chunks,
        integrity_errors=int(run["integrity_errors"]),
    )
    result.set(leaked_locks=run["leaked_locks"], leaked_pins=run["leaked_pins"])
    result.checks["the loopback slowed (tc shows the qdisc)"] = what.split()[0] in run["qdisc"]
    result.checks["every chunk written through over the slow link"] = run["writes"] == chunks
    result.checks["the first lookup missed with cause prefetch_timeout, counted"] = (
        run["first_miss_status"] == "prefetch_timeout" and run["prefetch_timeouts"] >= 1
    )
    result.checks["the chunks that arrived later hit"] = run["later_hit_chunks"] == chunks
    result.checks["the server stopped cleanly (exit 0)"] = run["server_exit"] == 0
    result.details.update(shape=what, **run)
    return result
