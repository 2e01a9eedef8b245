"""The replay engine's run."""

from __future__ import annotations

from testbed.engine.results import EngineResult
from testbed.run.interface import EngineEntry, EngineRun
from testbed.run.servable import engine_spec
from testbed.spec.runspec import RunSpec


def run(job: EngineRun) -> EngineResult:
    """vLLM's scheduler and the connector against the run's cache server, no model."""
    from testbed.engine.replay import ReplayEngine, ReplaySpec

    spec = engine_spec(ReplaySpec, job.spec, job.plan.requests)
    with ReplayEngine(spec, job.endpoints[0], work_dir=job.run_dir) as engine:
        return engine.run(job.plan.arrivals(), on_finish=job.progress.finished)


def replay_kv_bytes(spec: RunSpec, blocks: int, bytes_per_token: int) -> int:
    """The replay's worker harnesses: one int16 KV tensor per layer and TP rank."""
    per_rank = spec.kv_profile.bytes_per_token(spec.tp)
    return blocks * spec.block_size * per_rank * spec.tp


ENTRY = EngineEntry(run=run, engine_kv_bytes=replay_kv_bytes)
