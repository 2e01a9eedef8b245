"""Driving a run's engine: its entry in the registry, the cache servers it talks to, its
progress, and the servers' state after it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from testbed.engine.results import EngineResult
from testbed.run.interface import CacheServers, EngineEntry, EngineRun, Progress
from testbed.run.options import RunOptions
from testbed.run.plan import RunPlan
from testbed.run.registry import ENGINES
from testbed.run.server_state import server_state_after
from testbed.run.servers import RunServers, run_servers
from testbed.spec.runspec import RunSpec


@dataclass(frozen=True)
class EngineOutcome:
    """What the engine returned, the cache servers' state after it (summed), and the
    capacity that ran (each server's)."""

    result: EngineResult
    server_after: dict[str, Any] | None
    capacity_bytes: int | None


def drive_engine(
    plan: RunPlan,
    run_dir: Path,
    options: RunOptions,
    engine_done: Callable[[], None] = lambda: None,
) -> EngineOutcome:
    """Runs the plan's engine against the cache servers its entry asks for; ``engine_done`` is
    called once the engine has finished, before the servers are asked for their state."""
    spec = plan.spec
    entry = ENGINES[spec.engine]
    use = entry.cache_servers(options)
    if use is CacheServers.RUN:
        with run_servers(plan, run_dir, options) as servers:
            result = _run(entry, plan, run_dir, options, servers)
            engine_done()
            after = servers.state_after(session_owners(spec))
            return EngineOutcome(result, after, servers.capacity_bytes)
    result = _run(entry, plan, run_dir, options, RunServers([], [], None))
    after = None
    if use is CacheServers.OBSERVED and options.server is not None:
        after = server_state_after(options.server, owners=())  # its sessions are not ours
    capacity = plan.server_info.capacity_bytes if plan.server_info else plan.capacity_bytes
    return EngineOutcome(result, after, capacity)


def _run(
    entry: EngineEntry, plan: RunPlan, run_dir: Path, options: RunOptions, servers: RunServers
) -> EngineResult:
    progress = Progress(plan.spec, len(plan.served), options)
    try:
        job = EngineRun(plan, run_dir, options, servers.endpoints, servers.started, progress)
        return entry.run(job)
    finally:
        progress.close()


def is_fleet(spec: RunSpec) -> bool:
    """Whether the run's engine is instances behind a router (several, or a fleet of one)."""
    return spec.instances > 1 or ENGINES[spec.engine].fleet


def session_owners(spec: RunSpec) -> list[str]:
    """The engine ids the run's connector sessions are named under (``<id>:<request id>``):
    the run id, or one per instance of a fleet."""
    if is_fleet(spec):
        from testbed.engine.fleet import instance_engine_id

        return [instance_engine_id(spec.run_id, k) for k in range(spec.instances)]
    return [spec.run_id]
