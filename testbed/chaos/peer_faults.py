"""A peer cache server SIGKILLed while another server's engine run gets hits from it.

Runs in the chaos process. ``peer_kill``: three servers that are each other's peers (the
administration request a P2P fleet's run sends, ``testbed.run.servers.set_peers``); a first
replay stores its chunks into server B; a second replay of the same workload runs on server A,
whose lookups miss locally and are served from B (probe, fetch, copy: hit source ``p2p``); a
third of the way through the second run, B is SIGKILLed and never comes back. The run must
serve every request and end with its summary and rc 0, 0 integrity errors (a peer's bytes are
verified before they are committed); A counts the probes (or fetches) B did not answer, and no
engine step waits past the connector timeout + 1 s (the report's acceptance: a peer costs one
timeout, then is marked down). A and C stop cleanly.
"""

from __future__ import annotations

from server.launch import ServerProcess
from testbed.chaos.lab import CHUNK_SIZE, Lab
from testbed.chaos.probes import ProbeClient
from testbed.chaos.report import ScenarioResult
from testbed.core import protocol as p
from testbed.core.credentials import ServerEndpoint

_RUN_TIMEOUT_S = 300.0
_WORKLOAD = "docqa"


def peer_kill(lab: Lab) -> ScenarioResult:
    result = lab.result(
        "three servers that are each other's peers; a replay on A served from B's chunks, B "
        "SIGKILLed mid-run: the run serves every request and ends with its summary and rc 0, "
        "0 integrity errors, A counts the probes and fetches B did not answer, no engine step "
        "stuck, and the live servers stop cleanly",
    )
    a, b, c = (lab.server("--chunk-size", str(CHUNK_SIZE), "--capacity", "64MiB") for _ in "abc")
    from testbed.run.servers import set_peers  # the run package is heavy (kvtb's start)

    set_peers([ServerEndpoint(s.url, s.token, s.admin_token) for s in (a, b, c)])
    n = lab.config.run_requests
    spec = lab.spec(_WORKLOAD, n)
    first = lab.run(spec, b, "first")
    first.wait(_RUN_TIMEOUT_S)
    lab.record_run(result, first)
    child = lab.run(spec, a, "second")
    before = None
    if child.wait_for(max(1, n // 3), _RUN_TIMEOUT_S):
        before = _peers(a)
        lab.kill(b.pid)
    exit_code = child.wait(_RUN_TIMEOUT_S)
    summary = lab.record_run(result, child)
    after = _peers(a)
    for server in (a, c):
        lab.stop(server)
    # The next server start on this machine reclaims the dead peer's pool and token file.
    lab.server("--chunk-size", str(CHUNK_SIZE), "--capacity", "1MiB")
    failed = after.probe_failures + after.fetch_failures
    result.checks["the peer killed mid-run"] = before is not None
    result.checks["the run ended with its summary and rc 0"] = (
        summary is not None and exit_code == 0
    )
    result.checks["the peer's hits before the kill"] = before is not None and before.chunks > 0
    result.checks["the dead peer's unanswered probes/fetches counted"] = failed > 0
    result.checks["no corrupt object committed"] = after.corrupt_objects == 0
    result.checks["the live servers stopped cleanly (exit 0)"] = all(
        s.process is not None and s.process.returncode == 0 for s in (a, c)
    )
    result.details.update(
        peer_chunks=after.chunks,
        probe_failures=after.probe_failures,
        fetch_failures=after.fetch_failures,
        external_hit_tokens=(summary or {}).get("external_hit_tokens"),
    )
    return result


def _peers(server: ServerProcess) -> p.PeerStats:
    with ProbeClient(server.url, server.token) as probe:
        peers = probe.stats().peers
    return peers if peers is not None else p.PeerStats()
