"""The run's cache servers: the ``--server`` it was given, or those it starts (one, or one
per instance with servers 'per-instance'), each with the spec's chunk size, capacity, pool
and policy, its telemetry in the run directory and the spec's trace sampler; stopped when the
run is done with them. With ``p2p``, every per-instance server is told the others once all
are up (``server.peering``)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from server.launch import ServerProcess
from testbed.core import protocol as p
from testbed.core.credentials import ServerEndpoint
from testbed.core.rpc import RpcClient
from testbed.core.telemetry import sampling
from testbed.run import footprint
from testbed.run.interface import StartedServer
from testbed.run.options import RunOptions
from testbed.run.plan import RunPlan
from testbed.run.server_state import merged_states, server_state_after


@dataclass(frozen=True)
class RunServers:
    """The cache servers a run's engine talks to."""

    endpoints: Sequence[ServerEndpoint]
    started: Sequence[StartedServer]
    """Those the run started (empty with ``--server``)."""
    capacity_bytes: int | None
    """The capacity of each (an external server's as it answered)."""

    def state_after(self, owners: Sequence[str]) -> dict[str, Any] | None:
        """Every server's state once the engine is done, summed (``owners``: the engine ids
        whose connector sessions must be gone)."""
        return merged_states([server_state_after(e, owners) for e in self.endpoints])


@contextmanager
def run_servers(plan: RunPlan, run_dir: Path, options: RunOptions) -> Iterator[RunServers]:
    """The ``--server`` of ``options``, or servers started for the run (stopped on exit)."""
    if options.server is not None:
        capacity = plan.server_info.capacity_bytes if plan.server_info else None
        yield RunServers([options.server], [], capacity)
        return
    spec = plan.spec
    capacity = plan.capacity_bytes or _unlimited_capacity(plan)
    args = [
        "--chunk-size", str(spec.chunk_size),
        "--capacity", str(capacity),
        "--pool", spec.pool_medium,
        "--policy", spec.policy,
        "--run-dir", str(run_dir),
        "--run-id", spec.run_id,
    ]  # fmt: skip
    if spec.metadata_only:
        args.append("--metadata-only")
    if options.otlp_endpoint:
        args += ["--otlp-endpoint", options.otlp_endpoint]
    if options.otlp_protocol:
        args += ["--otlp-protocol", options.otlp_protocol]
    env = sampling.environment(spec.trace_sampler, spec.trace_sampler_ratio)
    count = spec.instances if spec.servers == "per-instance" else 1
    with ExitStack() as stack:
        started = []
        for k in range(count):
            log_path = run_dir / ("server.log" if k == 0 else f"server-{k}.log")
            process = ServerProcess(args, env=env, log_path=log_path).start()
            stack.callback(process.close)
            endpoint = ServerEndpoint(process.url, process.token, process.admin_token)
            started.append(StartedServer(endpoint, process.token_file))
        endpoints = [s.endpoint for s in started]
        if spec.p2p:
            set_peers(endpoints)
        yield RunServers(endpoints, started, capacity)


def set_peers(endpoints: Sequence[ServerEndpoint]) -> None:
    """Tells each server every other one as its peers (its admin request ``SetPeers``)."""
    for k, endpoint in enumerate(endpoints):
        peers = [
            p.PeerEndpoint(url=other.url, token=other.token)
            for j, other in enumerate(endpoints)
            if j != k
        ]
        with RpcClient(endpoint.url, role="run", token=endpoint.admin_token) as admin:
            admin.call(p.SetPeers(peers=peers))


def _unlimited_capacity(plan: RunPlan) -> int:
    """A capacity no run of these requests can fill: every prompt token stored once."""
    tokens = sum(len(r.prompt_token_ids) for r in plan.requests)
    return footprint.unlimited_capacity(tokens, plan.bytes_per_token)
