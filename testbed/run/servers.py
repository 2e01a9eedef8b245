"""The run's cache servers: the ``--server`` it was given, or those it starts (one, or one
per instance with servers 'per-instance'), each with the spec's chunk size, capacity, pool
and policy, its telemetry in the run directory and the spec's trace sampler; stopped when the
run is done with them. With ``p2p``, every per-instance server is told the others once all
are up (``server.peering``); redis tiers without a URL share the run's own Redis
(``testbed.run.redis_tiers``)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from server.launch import ServerProcess
from server.tiers.spec import parse_tier
from testbed.core import protocol as p
from testbed.core.credentials import ServerEndpoint
from testbed.core.rpc import RpcClient
from testbed.core.run_dir import RunDir
from testbed.core.telemetry import sampling
from testbed.run import footprint
from testbed.run.interface import StartedServer
from testbed.run.options import RunOptions
from testbed.run.plan import RunPlan
from testbed.run.redis_tiers import with_run_redis
from testbed.run.server_state import merged_states, server_state_after
from testbed.spec.runspec import RunSpec


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
        args += tier_arguments(spec, with_run_redis(spec.tiers, run_dir, stack))
        started = []
        for k in range(count):
            log_path = RunDir(run_dir).server_log(k)
            own = _tier_dir(spec, run_dir, k)
            if own is not None:  # the run's own disk tiers go with it
                stack.callback(shutil.rmtree, own.parent, True)
            tiers = [] if own is None else ["--tier-dir", str(own)]
            process = ServerProcess(args + tiers, env=env, log_path=log_path).start()
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
            p.PeerEndpoint(url=other.url, token=other.token, name=f"instance {j}")
            for j, other in enumerate(endpoints)
            if j != k
        ]
        with RpcClient(endpoint.url, role="run", token=endpoint.admin_token) as admin:
            admin.call(p.SetPeers(peers=peers))


def tier_arguments(spec: RunSpec, tiers: Sequence[str] | None = None) -> list[str]:
    """The server flags of the spec's tiers (or of ``tiers``, the same with the run's own
    Redis named) and their policies (none without tiers). A lookup may stay pending on its
    prefetch as long as the engine waits for it (the spec's server timeout), so under the
    ``wait`` policy a busy machine does not cut a prefetch short."""
    tiers = spec.tiers if tiers is None else tiers
    if not tiers:
        return []
    args = [flag for tier in tiers for flag in ("--tier", tier)]
    return args + [
        "--tier-write", spec.tier_write,
        "--tier-promote", spec.tier_promote,
        "--prefetch", spec.prefetch,
        "--lookup-pending-timeout", str(spec.server_timeout_s),
    ]  # fmt: skip


def _tier_dir(spec: RunSpec, run_dir: Path, number: int) -> Path | None:
    """Where server ``number``'s disk tiers without a directory keep their files (``None``:
    every tier names its own)."""
    if not any(parse_tier(tier).where is None for tier in spec.tiers):
        return None
    return run_dir / "tiers" / f"server-{number}"


def _unlimited_capacity(plan: RunPlan) -> int:
    """A capacity no run of these requests can fill: every prompt token stored once."""
    tokens = sum(len(r.prompt_token_ids) for r in plan.requests)
    return footprint.unlimited_capacity(tokens, plan.bytes_per_token)
