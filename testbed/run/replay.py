"""The replay engine's run, and the one function that makes its spec from a run's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from testbed.engine.results import EngineResult
from testbed.footprint import pool_blocks
from testbed.run.interface import EngineEntry, EngineRun
from testbed.run.servable import max_model_len
from testbed.runspec import RunSpec
from testbed.workloads import RequestShape

if TYPE_CHECKING:
    from testbed.engine.replay import ReplaySpec


def replay_spec(
    spec: RunSpec,
    requests: Sequence[RequestShape] = (),
    *,
    model_len: int | None = None,
    engine_blocks: int | None = None,
    run_id: str | None = None,
) -> ReplaySpec:
    """The replay engine's spec for a run of ``spec`` (every run key read from it): vLLM's
    ``max_model_len`` and KV pool resolved from ``requests`` (:func:`max_model_len`,
    ``testbed.footprint.pool_blocks``) unless given; ``run_id``: the connector's engine id
    (default: the spec's run id)."""
    from testbed.engine.replay import ReplaySpec

    return ReplaySpec(
        profile=spec.kv_profile,
        chunk_size=spec.chunk_size,
        tp=spec.tp,
        block_size=spec.block_size,
        engine_blocks=engine_blocks or pool_blocks(spec, requests),
        max_num_batched_tokens=spec.max_num_batched_tokens,
        max_num_seqs=spec.max_num_seqs,
        max_model_len=model_len or max_model_len(requests, spec.block_size),
        load_async=spec.load_async,
        prefix_caching=spec.prefix_caching,
        transfer_mode=spec.transfer_mode,
        store_wait=spec.store_wait,
        arrival=spec.arrival,
        fault_drop_fraction=spec.fault_drop_fraction,
        seed=spec.seed,
        metadata_only=spec.metadata_only,
        timeout_s=spec.server_timeout_s,
        time_profile=spec.time_profile,
        compute_profile=spec.compute_profile,
        run_id=run_id or spec.run_id,
    )


def run(job: EngineRun) -> EngineResult:
    """vLLM's scheduler and the connector against the run's cache server, no model."""
    from testbed.engine.replay import ReplayEngine

    spec = replay_spec(job.spec, job.plan.requests)
    with ReplayEngine(spec, job.endpoints[0], work_dir=job.run_dir) as engine:
        return engine.run(job.plan.arrivals(), on_finish=job.progress.finished)


def replay_kv_bytes(spec: RunSpec, blocks: int, bytes_per_token: int) -> int:
    """The replay's worker harnesses: one int16 KV tensor per layer and TP rank."""
    per_rank = spec.kv_profile.bytes_per_token(spec.tp)
    return blocks * spec.block_size * per_rank * spec.tp


ENTRY = EngineEntry(run=run, engine_kv_bytes=replay_kv_bytes)
