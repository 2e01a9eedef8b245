"""The fleet engine's run: replay instances behind the spec's router."""

from __future__ import annotations

from testbed.engine.results import EngineResult
from testbed.run.interface import EngineEntry, EngineRun
from testbed.run.replay import replay_kv_bytes
from testbed.run.servable import engine_spec
from testbed.spec.runspec import RunSpec


def run(job: EngineRun) -> EngineResult:
    """``instances`` replay instances on one virtual clock against the run's cache servers
    (one shared, or one per instance)."""
    from testbed.engine.fleet import FleetEngine
    from testbed.engine.replay_spec import ReplaySpec
    from testbed.fleet.routers import make_router, with_peers

    spec = job.spec
    replay = engine_spec(ReplaySpec, spec, job.plan.requests)
    params = with_peers(spec.router, spec.router_params, spec.p2p)
    router = make_router(spec.router, params, spec.instances, spec.seed)
    servers = list(job.endpoints)
    with FleetEngine(replay, router, servers, spec.instances, work_dir=job.run_dir) as fleet:
        return fleet.run(job.plan.arrivals(), on_finish=job.progress.finished)


def fleet_kv_bytes(spec: RunSpec, blocks: int, bytes_per_token: int) -> int:
    """Every instance's worker harnesses."""
    return spec.instances * replay_kv_bytes(spec, blocks, bytes_per_token)


ENTRY = EngineEntry(run=run, engine_kv_bytes=fleet_kv_bytes, fleet=True)
