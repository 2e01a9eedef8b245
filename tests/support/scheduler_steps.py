"""vLLM's scheduler with the real connector and a real cache server, stepped by hand.

The replay engine's parts (vLLM's ``Scheduler``, the WORKER-role connector of every rank, the
runner output vLLM's executor would aggregate), driven one step at a time as vLLM's own
connector unit tests drive theirs (``tests/v1/kv_connector/unit/utils.py`` in vLLM's
repository): tests can act between a step's scheduling and its execution (pause the server,
drop a chunk), run until the scheduler is idle, and check that it leaked nothing
(:func:`assert_scheduler_empty`) before checking the server.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from testbed.core.credentials import ServerEndpoint
from testbed.engine.replay import ReplayEngine, ReplaySpec
from testbed.workloads import WorkloadRequest
from tests.support.cache_harness import ServerLike


@contextmanager
def stepped_engine(server: ServerLike, work_dir: Path, **spec: object) -> Iterator[ReplayEngine]:
    """A replay engine against ``server`` (tiny profile, vLLM's prefix cache off so that
    repeats come from the cache server; ``spec`` overrides fields of :class:`ReplaySpec` and
    of the run's spec it holds)."""
    options: dict = dict(
        chunk_size=64,
        block_size=32,
        engine_blocks=256,
        max_model_len=2048,
        prefix_caching=False,
        server_timeout_s=2.0,
        time_profile="flat",
        engine_id="replay",
    )
    options.update(spec)
    endpoint = ServerEndpoint(server.url, server.token, server.admin_token)
    with ReplayEngine(ReplaySpec.of(**options), endpoint, work_dir=work_dir) as engine:
        yield engine


def request(
    request_id: str, tokens: np.ndarray, output: int = 2, **extras: object
) -> WorkloadRequest:
    return WorkloadRequest(request_id, tokens.astype(np.int32), output, 0.0, **extras)


def prompt(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30_000, n).astype(np.int32)


def run_until_idle(engine: ReplayEngine, max_steps: int = 500) -> set[int]:
    """Steps until vLLM's scheduler holds no request; the blocks reported failed to load."""
    failed: set[int] = set()
    for _ in range(max_steps):
        if not engine.scheduler.has_requests():
            return failed
        _, outcomes = engine.execute(engine.scheduler.schedule())
        failed |= {block for outcome in outcomes for block in outcome.invalid_block_ids}
    raise AssertionError(f"still busy after {max_steps} steps: {list(engine.scheduler.requests)}")


def assert_scheduler_empty(scheduler) -> None:
    """Nothing leaked in vLLM's scheduler: no request, no pending transfer, every block free
    (vLLM's own connector tests end with the same checks)."""
    assert not scheduler.finished_req_ids and not scheduler.finished_recving_kv_req_ids
    assert not scheduler.failed_recving_kv_req_ids and not scheduler._inflight_prefills
    assert_blocks_free(scheduler)


def assert_blocks_free(scheduler) -> None:
    """No request holds anything in vLLM's scheduler: none is tracked (finished ones whose
    blocks it keeps for their connector included), every block is free. Holds right after
    the step that finished the last request (its id still waits in ``finished_req_ids`` to
    reach the workers with the next step)."""
    assert not scheduler.requests and not scheduler.waiting and not scheduler.running
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    assert not manager.req_to_blocks and not manager.num_cached_block
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.free_block_queue.num_free_blocks == pool.num_gpu_blocks - 1  # the null block
    assert all(block.ref_cnt == 0 for block in pool.blocks)
